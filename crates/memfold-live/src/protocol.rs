//! The memfoldd socket protocol (version [`PROTOCOL_VERSION`]).
//!
//! A Unix `SOCK_SEQPACKET` socket: one message per packet, JSON, with file descriptors
//! passed alongside (SCM_RIGHTS), the way Firecracker hands guest memory to an external
//! page-fault handler. The first message of a connection says who speaks:
//! [`ToDaemon::AgentHello`] (an agent in a QEMU process, with the guest memfd) or
//! [`ToDaemon::ClientHello`] (a command asking for statistics).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// Protocol version; a peer with another version is refused with a clear message.
pub const PROTOCOL_VERSION: u32 = 4;

/// Largest message, bytes (a share batch of [`MAX_BATCH`] pages is about 12 KiB).
pub const MAX_MESSAGE: usize = 256 * 1024;

/// Most pages in one share or reclaim request.
pub const MAX_BATCH: usize = 512;

/// In a re-attach list, the "frame" of a reclaimed zero page (it is a hole in the guest
/// memfd; the agent fills it with zeros on the next access).
pub const RECLAIMED_ZERO: u32 = u32::MAX - 1;

/// Most pages in one clock slice ([`ToAgent::ClockScan`]).
pub const CLOCK_SLICE: u32 = 16384;

/// In [`StashPage::reference`]: the blob is not a patch.
pub const NO_REFERENCE: u32 = u32::MAX;

/// In [`StashPage::kind`]: the blob is the page itself, 4096 bytes (a page swapped out
/// that neither patched nor compressed under the cut-off, DE §4.6).
pub const RAW_PAGE: u8 = u8::MAX;

/// A page to keep as a blob instead of in guest RAM: a Difference Engine §3.2 patch or
/// §3.3 compressed page in the store memfd, or (§4.6) any of these or the raw page in
/// the swap file.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct StashPage {
    /// Guest frame.
    pub gfn: u32,
    /// Encoding: `memfold_core::blobstore::BlobKind::to_byte`, or [`RAW_PAGE`].
    pub kind: u8,
    /// Pool frame a patch is made against ([`NO_REFERENCE`] for a compressed page).
    pub reference: u32,
    /// Byte offset of the blob in the store memfd (or the swap file).
    pub offset: u64,
    /// Blob length, bytes.
    pub len: u32,
    /// The blob is in the swap file (DE §4.6), not in the store memfd.
    pub in_swap: bool,
    /// The page is stashed already (its blob in the store memfd) and this moves it to
    /// the swap file (DE §4.6: compressed and patched pages are swap candidates too):
    /// the agent replaces its record only if the page is still stashed in the store and
    /// the new blob decodes to the same bytes; otherwise it refuses.
    pub moving: bool,
}

/// What the agent measured since it started: fault counts and operation latencies as
/// (ns, count) histogram pairs ([`crate::latency::OpLatency::to_pairs`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct AgentReport {
    /// Write faults on write-protected pages (CoW breaks and writers waiting on a share
    /// or reclaim in progress).
    pub wp_faults: u64,
    /// Faults on missing pages (first touches and reclaimed pages), served by the agent.
    pub missing_faults: u64,
    /// Minor faults (first access to a page since the clock re-armed it).
    pub minor_faults: u64,
    /// Share, per page (a run's time divided over its pages).
    pub share_ns: Vec<(u64, u64)>,
    /// CoW break, from reading the fault to waking the writer.
    pub cow_break_ns: Vec<(u64, u64)>,
    /// Missing-fault service, from reading the fault to waking the thread.
    pub fault_ns: Vec<(u64, u64)>,
    /// Reclaim, per page.
    pub reclaim_ns: Vec<(u64, u64)>,
    /// Minor-fault service (the clock's R/M tracking), from reading the fault to waking.
    pub track_ns: Vec<(u64, u64)>,
    /// Stash (check a blob still decodes to the page, punch the page), per page.
    pub stash_ns: Vec<(u64, u64)>,
    /// Missing fault on a stashed page: read and decode the blob, install the page.
    pub unstash_ns: Vec<(u64, u64)>,
}

/// Messages to memfoldd.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToDaemon {
    /// An agent attaches its guest. Carries the guest RAM memfd; when re-attaching after a
    /// memfoldd restart also the pool memfd and a memfd listing its pool mappings.
    AgentHello {
        /// Protocol version.
        version: u32,
        /// Guest name.
        name: String,
        /// QEMU's pid.
        pid: u32,
        /// Guest RAM, bytes.
        ram_bytes: u64,
        /// Pages mapped onto pool frames or reclaimed: the third descriptor holds as many
        /// (gfn, frame) pairs, two little-endian u32 each (a list too long for one
        /// message); a reclaimed zero page has frame [`RECLAIMED_ZERO`].
        shared: u64,
    },
    /// Result of a [`ToAgent::Share`] request.
    ShareDone {
        /// The request's batch number.
        batch: u64,
        /// Gfns now mapped onto their frame.
        shared: Vec<u32>,
        /// Gfns whose content no longer matched the frame (left private).
        changed: Vec<u32>,
        /// Gfns not shared for another reason (already shared, VMA budget reached).
        refused: Vec<u32>,
    },
    /// Copy-on-write breaks done by the agent: (gfn, frame it left).
    CowBroken {
        /// (gfn, frame) pairs.
        breaks: Vec<(u32, u32)>,
    },
    /// Result of a [`ToAgent::ReclaimZero`] request.
    ReclaimDone {
        /// The request's batch number.
        batch: u64,
        /// Gfns now holes in the guest memfd.
        reclaimed: Vec<u32>,
        /// Gfns no longer zero (left as they are).
        changed: Vec<u32>,
        /// Gfns not reclaimed for another reason (shared or reclaimed already).
        refused: Vec<u32>,
    },
    /// Result of a [`ToAgent::Stash`] request.
    StashDone {
        /// The request's batch number.
        batch: u64,
        /// Gfns now holes in the guest memfd, their content in the store.
        stashed: Vec<u32>,
        /// Gfns whose content no longer decodes from the blob (left as they are).
        changed: Vec<u32>,
        /// Gfns not stashed for another reason (not private, unreadable blob).
        refused: Vec<u32>,
    },
    /// Stashed pages the guest accessed again: the agent decoded them back (private).
    Unstashed {
        /// Gfns.
        gfns: Vec<u32>,
    },
    /// Reclaimed pages the guest accessed again: the agent filled them (private again).
    Refilled {
        /// Gfns.
        gfns: Vec<u32>,
    },
    /// R and M bits of a clock slice since it was last armed (DE §4.2), answering
    /// [`ToAgent::ClockScan`]: bit k of word k/64 is gfn `first + k`.
    ClockBits {
        /// The request's batch number.
        batch: u64,
        /// First gfn of the slice.
        first: u32,
        /// Pages in the slice.
        count: u32,
        /// Referenced bits.
        referenced: Vec<u64>,
        /// Modified bits.
        modified: Vec<u64>,
    },
    /// The agent's fault counts and latencies, sent about once a second.
    AgentStats(AgentReport),
    /// A command line client attaches (then sends [`ToDaemon::Stats`]).
    ClientHello {
        /// Protocol version.
        version: u32,
    },
    /// Asks for [`ToClient::Stats`].
    Stats,
}

/// Messages to an agent.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToAgent {
    /// The guest is attached; carries the pool memfd, the store memfd (blobs of stashed
    /// pages) and, when memfoldd keeps a host memory budget, the swap file.
    Welcome {
        /// Protocol version.
        version: u32,
    },
    /// Map these guest pages onto these pool frames if their content still equals the
    /// frame's: (gfn, frame) pairs, at most [`MAX_BATCH`].
    Share {
        /// Batch number, echoed in the reply.
        batch: u64,
        /// (gfn, frame) pairs.
        pages: Vec<(u32, u32)>,
    },
    /// Reclaim these guest pages if they are still all zero: punch them out of the guest
    /// memfd; the next access faults (missing) and the agent fills a zero page (ESX §4.3's
    /// zero page, without a frame or a mapping: no VMA is spent). At most [`MAX_BATCH`].
    ReclaimZero {
        /// Batch number, echoed in the reply.
        batch: u64,
        /// Gfns.
        gfns: Vec<u32>,
    },
    /// Keep these guest pages as blobs already written to the store memfd or the swap
    /// file, if each blob still decodes to the page's bytes: punch the pages out of the
    /// guest memfd; the next access faults (missing) and the agent decodes the page back.
    /// A hint: the agent refuses pages it cannot check. At most [`MAX_BATCH`].
    Stash {
        /// Batch number, echoed in the reply.
        batch: u64,
        /// The pages and their blobs.
        pages: Vec<StashPage>,
    },
    /// Report the R and M bits of gfns `[first, first+count)` since they were last armed,
    /// and arm them again: write-protect private pages (a write faults: M) and zap their
    /// PTEs (any access faults as minor: R). At most [`CLOCK_SLICE`] pages.
    ClockScan {
        /// Batch number, echoed in the reply.
        batch: u64,
        /// First gfn.
        first: u32,
        /// Pages.
        count: u32,
    },
}

/// Messages to a client.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToClient {
    /// The daemon's statistics.
    Stats(Box<crate::daemon::stats::Stats>),
    /// The request was refused.
    Error {
        /// Why.
        message: String,
    },
}

/// One end of a memfoldd connection.
pub struct Conn {
    fd: OwnedFd,
}

/// Creates a `SOCK_SEQPACKET` socket.
fn seqpacket() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall returning a new fd or -1.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn sockaddr(path: &Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: all-zero is a valid sockaddr_un.
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

/// A listening memfoldd socket.
pub struct Listener {
    fd: OwnedFd,
}

impl Listener {
    /// Binds `path` (removing a stale socket file first).
    ///
    /// Errors: the path is too long, its folder is missing or not writable.
    pub fn bind(path: &Path) -> io::Result<Listener> {
        let _ = std::fs::remove_file(path);
        let fd = seqpacket()?;
        let (addr, len) = sockaddr(path)?;
        // SAFETY: addr is a valid sockaddr_un of length len.
        if unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &addr as *const _ as *const libc::sockaddr,
                len,
            )
        } != 0
            || unsafe { libc::listen(fd.as_raw_fd(), 64) } != 0
        {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("binding {}: {e}", path.display()),
            ));
        }
        Ok(Listener { fd })
    }

    /// Waits for the next connection.
    ///
    /// Errors: accept failed.
    pub fn accept(&self) -> io::Result<Conn> {
        // SAFETY: accept4 with null address returns a new fd or -1.
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
        // SAFETY: fresh fd we own.
        Ok(Conn {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }
}

impl Conn {
    /// Connects to memfoldd at `path`.
    ///
    /// Errors: no daemon listens there.
    pub fn connect(path: &Path) -> io::Result<Conn> {
        let fd = seqpacket()?;
        let (addr, len) = sockaddr(path)?;
        // SAFETY: addr is a valid sockaddr_un of length len.
        if unsafe {
            libc::connect(
                fd.as_raw_fd(),
                &addr as *const _ as *const libc::sockaddr,
                len,
            )
        } != 0
        {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("connecting to memfoldd at {}: {e}", path.display()),
            ));
        }
        Ok(Conn { fd })
    }

    /// A second handle on the same connection (one thread reads, another writes).
    ///
    /// Errors: out of file descriptors.
    pub fn try_clone(&self) -> io::Result<Conn> {
        Ok(Conn {
            fd: self.fd.try_clone()?,
        })
    }

    /// Sends one message with `fds` attached.
    ///
    /// Errors: the peer is gone, or the message exceeds [`MAX_MESSAGE`].
    pub fn send<T: Serialize>(&self, msg: &T, fds: &[RawFd]) -> io::Result<()> {
        let bytes = serde_json::to_vec(msg).map_err(io::Error::other)?;
        if bytes.len() > MAX_MESSAGE {
            return Err(io::Error::other(format!(
                "message of {} bytes exceeds {MAX_MESSAGE}",
                bytes.len()
            )));
        }
        let mut iov = libc::iovec {
            iov_base: bytes.as_ptr() as *mut libc::c_void,
            iov_len: bytes.len(),
        };
        // SAFETY: msghdr zeroed then filled with valid pointers that outlive the call.
        let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
        hdr.msg_iov = &mut iov;
        hdr.msg_iovlen = 1;
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
        let mut cbuf = vec![0u8; space];
        if !fds.is_empty() {
            hdr.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
            hdr.msg_controllen = space;
            // SAFETY: the control buffer has room for one cmsg with fds.len() fds.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&hdr);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as usize;
                std::ptr::copy_nonoverlapping(
                    fds.as_ptr(),
                    libc::CMSG_DATA(c) as *mut RawFd,
                    fds.len(),
                );
            }
        }
        loop {
            // SAFETY: hdr points at valid buffers.
            let n = unsafe { libc::sendmsg(self.fd.as_raw_fd(), &hdr, libc::MSG_NOSIGNAL) };
            if n >= 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// Receives one message and the descriptors passed with it. `Ok(None)` at end of
    /// connection.
    ///
    /// Errors: a malformed message (says what could not be parsed), or a socket error.
    pub fn recv<T: DeserializeOwned>(&self) -> io::Result<Option<(T, Vec<OwnedFd>)>> {
        let mut buf = vec![0u8; MAX_MESSAGE];
        let mut cbuf = [0u8; 128];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr() as *mut libc::c_void,
            iov_len: buf.len(),
        };
        // SAFETY: msghdr zeroed then filled with valid pointers that outlive the call.
        let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
        hdr.msg_iov = &mut iov;
        hdr.msg_iovlen = 1;
        hdr.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        hdr.msg_controllen = cbuf.len();
        let n = loop {
            // SAFETY: hdr points at valid buffers.
            let n = unsafe { libc::recvmsg(self.fd.as_raw_fd(), &mut hdr, libc::MSG_CMSG_CLOEXEC) };
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        let mut fds = Vec::new();
        // SAFETY: walking the control messages the kernel filled in.
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
        if n == 0 {
            return Ok(None);
        }
        let msg = serde_json::from_slice(&buf[..n]).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("malformed memfoldd message ({n} bytes): {e}"),
            )
        })?;
        Ok(Some((msg, fds)))
    }
}

impl AsRawFd for Conn {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_and_descriptors_cross_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let l = Listener::bind(&path).unwrap();
        let c = Conn::connect(&path).unwrap();
        let s = l.accept().unwrap();
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        let hello = ToDaemon::AgentHello {
            version: PROTOCOL_VERSION,
            name: "g".into(),
            pid: 1,
            ram_bytes: 4096,
            shared: 0,
        };
        c.send(&hello, &[f.as_raw_fd()]).unwrap();
        let (m, fds): (ToDaemon, _) = s.recv().unwrap().unwrap();
        assert_eq!(m, hello);
        assert_eq!(fds.len(), 1);
        drop(c);
        assert!(s.recv::<ToDaemon>().unwrap().is_none(), "end of connection");
    }
}
