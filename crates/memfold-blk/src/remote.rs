//! QEMU as a remote process: its identity (a pidfd, never a bare pid), its memory read
//! and written through its own page tables (`process_vm_readv`/`process_vm_writev`), and
//! where it maps a file (`/proc/PID/maps`).
//!
//! Why `process_vm_*` and not `/proc/PID/mem`: both fault through the target's page
//! tables, but the kernel's `/proc/PID/mem` path (`access_remote_vm`) pins pages without
//! being allowed to drop the mmap lock and retry, so a userfaultfd-registered page (a
//! page memfold's agent stashed, reclaimed or write-protected) answers `EIO` at once
//! instead of waiting for the agent; `process_vm_*` may retry and so waits for the
//! fault handler, as a vCPU does.
//!
//! `process_vm_writev` pins the pages and copies after, so a page the agent
//! write-protects in between takes the copy without a fault; every write therefore holds
//! the agent's write fence over its pages ([`Qemu::write`], `memfold_sys::fence`).

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use memfold_sys::fence::WriteFence;

/// At most this many iovecs per `process_vm_*` call (the kernel's `UIO_MAXIOV`).
const MAX_IOV: usize = 1024;

/// `process_vm_readv` or `process_vm_writev` (one signature).
type VmRw = unsafe extern "C" fn(
    libc::pid_t,
    *const libc::iovec,
    libc::c_ulong,
    *const libc::iovec,
    libc::c_ulong,
    libc::c_ulong,
) -> libc::ssize_t;

/// Errors of reaching QEMU.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// QEMU (the pidfd's process) has exited: nothing more is read or written, since its
    /// pid may already name another process.
    #[error("QEMU (pid {pid}) has exited")]
    Gone {
        /// The pid it had.
        pid: u32,
    },
    /// A `process_vm_readv`/`process_vm_writev` call failed.
    #[error("{op} of {len} bytes at QEMU address {addr:#x} (pid {pid}): {source}")]
    Access {
        /// `process_vm_readv` or `process_vm_writev`.
        op: &'static str,
        /// QEMU's virtual address of the first byte not transferred.
        addr: u64,
        /// Bytes not transferred.
        len: usize,
        /// QEMU's pid.
        pid: u32,
        /// The OS error (`EFAULT`: not mapped in QEMU; `ESRCH`: gone; `EPERM`: no right
        /// to ptrace it).
        source: io::Error,
    },
    /// QEMU holds a descriptor named as the agent's write fence that is not one.
    #[error("QEMU (pid {pid})'s write fence: {source}")]
    Fence {
        /// QEMU's pid.
        pid: u32,
        /// What was wrong.
        source: io::Error,
    },
    /// A pidfd could not be opened or read.
    #[error("pidfd of pid {pid}: {source}")]
    Pidfd {
        /// The pid (0: not known yet).
        pid: u32,
        /// The OS error.
        source: io::Error,
    },
    /// The vhost-user connection's peer could not be identified.
    #[error("the peer of the vhost-user socket {path}: {what}")]
    Peer {
        /// The socket's path.
        path: PathBuf,
        /// What went wrong.
        what: String,
    },
    /// The peer is not the QEMU named on the command line (`--qemu-pid`).
    #[error("the vhost-user peer is pid {peer}, not the expected QEMU pid {expected}")]
    WrongPeer {
        /// The peer's pid.
        peer: u32,
        /// The pid expected.
        expected: u32,
    },
    /// No single mapping of a guest RAM file in QEMU covers a region.
    #[error("QEMU (pid {pid}) maps file {dev}:{ino} bytes [{off:#x}, +{len:#x}) {what}")]
    NotMapped {
        /// QEMU's pid.
        pid: u32,
        /// The file's device (`st_dev`).
        dev: u64,
        /// The file's inode.
        ino: u64,
        /// File offset, bytes.
        off: u64,
        /// Length, bytes.
        len: u64,
        /// `nowhere`, or at two different addresses.
        what: String,
    },
    /// `/proc/PID/maps` could not be read.
    #[error("/proc/{pid}/maps: {source}")]
    Maps {
        /// QEMU's pid.
        pid: u32,
        /// The OS error.
        source: io::Error,
    },
}

/// A running QEMU: its pid and a pidfd on it.
///
/// Before every transfer the pidfd is polled: once QEMU has exited nothing is read or
/// written again ([`RemoteError::Gone`]). What remains is the window between that check
/// and the system call, microseconds, in which the pid would have to be freed and handed
/// to a new process (a wrap of `pid_max`); `process_vm_*` take no pidfd, so it cannot be
/// closed entirely.
#[derive(Debug)]
pub struct Qemu {
    pid: u32,
    pidfd: OwnedFd,
    /// The write fence of QEMU's agent, if it runs one: every write holds it (see
    /// [`Qemu::write`]).
    fence: Option<WriteFence>,
}

impl Qemu {
    /// The process `pid`, held by a new pidfd (tests, and `--qemu-pid` when the peer
    /// cannot be asked).
    ///
    /// Errors: [`RemoteError::Pidfd`] (no such process).
    pub fn open(pid: u32) -> Result<Qemu, RemoteError> {
        let pidfd =
            memfold_sys::pidfd::open(pid).map_err(|source| RemoteError::Pidfd { pid, source })?;
        Qemu::with_fence(pid, pidfd)
    }

    /// `pid` held by `pidfd`, with its agent's write fence if it has one.
    ///
    /// Errors: [`RemoteError::Fence`].
    fn with_fence(pid: u32, pidfd: OwnedFd) -> Result<Qemu, RemoteError> {
        let fence = WriteFence::of_process(pidfd.as_fd(), pid)
            .map_err(|source| RemoteError::Fence { pid, source })?;
        Ok(Qemu { pid, pidfd, fence })
    }

    /// Whether QEMU's agent has a write fence this device holds on every write.
    pub fn fenced(&self) -> bool {
        self.fence.is_some()
    }

    /// The process a pidfd names; its pid read from `/proc/self/fdinfo`.
    ///
    /// Errors: [`RemoteError::Pidfd`] (not a pidfd, or its process has exited: pid -1).
    pub fn from_pidfd(pidfd: OwnedFd) -> Result<Qemu, RemoteError> {
        let pid = memfold_sys::pidfd::pid_of(pidfd.as_fd()).ok_or_else(|| RemoteError::Pidfd {
            pid: 0,
            source: io::Error::other("not a pidfd, or its process has exited"),
        })?;
        Qemu::with_fence(pid, pidfd)
    }

    /// The peer of the connected unix socket `sock`: by `SO_PEERPIDFD` where the kernel
    /// has it, else by `SO_PEERCRED`'s pid opened as a pidfd (and checked to be alive).
    ///
    /// Errors: [`RemoteError::Pidfd`].
    pub fn peer_of(sock: BorrowedFd<'_>) -> Result<Qemu, RemoteError> {
        let pidfd = memfold_sys::pidfd::of_peer(sock)
            .map_err(|source| RemoteError::Pidfd { pid: 0, source })?;
        Qemu::from_pidfd(pidfd)
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Its pidfd.
    pub fn pidfd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }

    /// Whether it still runs (its pidfd does not poll readable, which it does once the
    /// process has exited).
    pub fn alive(&self) -> bool {
        memfold_sys::pidfd::alive(self.pidfd.as_fd())
    }

    /// Errors: [`RemoteError::Gone`] once it has exited.
    pub fn check_alive(&self) -> Result<(), RemoteError> {
        if self.alive() {
            Ok(())
        } else {
            Err(RemoteError::Gone { pid: self.pid })
        }
    }

    /// Reads QEMU's memory: each `(addr, buf)` fills `buf` from QEMU's virtual address
    /// `addr`, through QEMU's page tables (a page QEMU would fault on is faulted in for
    /// QEMU, a userfaultfd-registered one waits for its handler).
    ///
    /// Errors: [`RemoteError::Gone`]; [`RemoteError::Access`] (the first byte not read).
    pub fn read(&self, parts: &mut [(u64, &mut [u8])]) -> Result<(), RemoteError> {
        let parts: Vec<(u64, *mut u8, usize)> = parts
            .iter_mut()
            .map(|(a, b)| (*a, b.as_mut_ptr(), b.len()))
            .collect();
        // SAFETY: each pointer is a live buffer of the caller's, mutably borrowed for the
        // call, of its length.
        unsafe { self.transfer("process_vm_readv", libc::process_vm_readv, &parts) }
    }

    /// Writes QEMU's memory: each `(addr, buf)` goes to QEMU's virtual address `addr`,
    /// through QEMU's page tables, as a guest write would (a write-protected page waits
    /// for the userfaultfd handler to unprotect or remap it; a missing one for its fill).
    ///
    /// The invariant kept here: **the pages written are held in the agent's write fence
    /// from before the system call pins them until it has copied into them**, so the
    /// agent never maps a frame over, or punches out, a page whose copy is still to come
    /// (`memfold_sys::fence`; broken on purpose in `memfold-agent/tests/pinned_writes.rs`).
    /// The whole pages of `parts` are declared overwritten for the call
    /// (`WriteFence::hold_writing`: Satori §4.3's no-copy-on-write; the agent's
    /// `nocopy.rs`).
    ///
    /// Errors: [`RemoteError::Gone`]; [`RemoteError::Access`] (the first byte not
    /// written; bytes before it are written).
    pub fn write(&self, parts: &[(u64, &[u8])]) -> Result<(), RemoteError> {
        let parts: Vec<(u64, *mut u8, usize)> = parts
            .iter()
            .map(|(a, b)| (*a, b.as_ptr().cast_mut(), b.len()))
            .collect();
        // Held, and its whole pages declared overwritten (the agent breaks those on
        // frames without a copy, all at the first fault: `memfold_sys::fence`). Every
        // call below writes every byte of every part, or fails.
        let ranges: Vec<(u64, u64)> = parts.iter().map(|&(a, _, n)| (a, n as u64)).collect();
        let _held = self.fence.as_ref().map(|f| f.hold_writing(&ranges));
        // SAFETY: each pointer is a live buffer of the caller's, of its length;
        // process_vm_writev only reads the local side.
        unsafe { self.transfer("process_vm_writev", libc::process_vm_writev, &parts) }
    }

    /// Moves each `(addr, local, len)` between QEMU's address `addr` and the local buffer
    /// with `call` (`process_vm_readv` or `process_vm_writev`, named `op` in errors),
    /// [`MAX_IOV`] parts a call, again after a short transfer or `EINTR`, checking QEMU
    /// is alive before each call.
    ///
    /// # Safety
    /// Each `local` must point to `len` bytes valid for `call` (writable for a read) for
    /// the whole call.
    unsafe fn transfer(
        &self,
        op: &'static str,
        call: VmRw,
        parts: &[(u64, *mut u8, usize)],
    ) -> Result<(), RemoteError> {
        for chunk in parts.chunks(MAX_IOV) {
            let mut done: Vec<usize> = vec![0; chunk.len()];
            loop {
                let pending: Vec<usize> =
                    (0..chunk.len()).filter(|&i| done[i] < chunk[i].2).collect();
                let Some(&first) = pending.first() else {
                    break;
                };
                // Once a call, right before it: not again once all is moved (that second
                // poll was half of a request's system calls).
                self.check_alive()?;
                let iov = |base: &dyn Fn(usize) -> *mut libc::c_void| -> Vec<libc::iovec> {
                    pending
                        .iter()
                        .map(|&i| libc::iovec {
                            iov_base: base(i),
                            iov_len: chunk[i].2 - done[i],
                        })
                        .collect()
                };
                // `done[i] < len`: within the buffer.
                let local = iov(&|i| chunk[i].1.wrapping_add(done[i]).cast());
                let remote = iov(&|i| (chunk[i].0 + done[i] as u64) as *mut libc::c_void);
                // SAFETY: the local iovecs lie within the caller's buffers (this function's
                // contract); the remote ones are only addresses in QEMU.
                let n = unsafe {
                    call(
                        self.pid as libc::pid_t,
                        local.as_ptr(),
                        local.len() as libc::c_ulong,
                        remote.as_ptr(),
                        remote.len() as libc::c_ulong,
                        0,
                    )
                };
                let err = io::Error::last_os_error();
                if n < 0 && err.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                if n <= 0 {
                    return Err(self.access_error(
                        op,
                        chunk[first].0 + done[first] as u64,
                        chunk[first].2 - done[first],
                        if n == 0 {
                            io::Error::from_raw_os_error(libc::EFAULT)
                        } else {
                            err
                        },
                    ));
                }
                advance(&mut done, &pending, chunk.iter().map(|p| p.2), n as usize);
            }
        }
        Ok(())
    }

    fn access_error(
        &self,
        op: &'static str,
        addr: u64,
        len: usize,
        source: io::Error,
    ) -> RemoteError {
        if !self.alive() || source.raw_os_error() == Some(libc::ESRCH) {
            return RemoteError::Gone { pid: self.pid };
        }
        RemoteError::Access {
            op,
            addr,
            len,
            pid: self.pid,
            source,
        }
    }

    /// QEMU's virtual address of byte `off` of the file `(dev, ino)`, for the `len` bytes
    /// from there: every shared mapping of that file in QEMU (`/proc/PID/maps`) that
    /// covers part of the range must place it at one and the same address, and the parts
    /// they cover must not leave a byte of the range to another mapping of the file.
    /// Parts mapped from other files (memfold's agent maps pool frames over shared guest
    /// pages) are allowed: the address is QEMU's RAM block's, the kernel follows whatever
    /// QEMU maps there.
    ///
    /// Errors: [`RemoteError::Maps`]; [`RemoteError::NotMapped`] (no mapping of the file
    /// covers the range, or two place it differently).
    pub fn file_address(&self, dev: u64, ino: u64, off: u64, len: u64) -> Result<u64, RemoteError> {
        let path = format!("/proc/{}/maps", self.pid);
        let maps = std::fs::read_to_string(&path).map_err(|source| RemoteError::Maps {
            pid: self.pid,
            source,
        })?;
        self.check_alive()?;
        let not_mapped = |what: String| RemoteError::NotMapped {
            pid: self.pid,
            dev,
            ino,
            off,
            len,
            what,
        };
        let mut base: Option<u64> = None;
        for m in maps.lines().filter_map(MapsLine::parse) {
            if (m.dev, m.ino) != (dev, ino) || !m.shared {
                continue;
            }
            let (f0, f1) = (m.off, m.off + (m.end - m.start));
            if f1 <= off || f0 >= off + len {
                continue;
            }
            // The address of file byte `off` if this mapping continued that far.
            let Some(b) = (m.start + off).checked_sub(m.off) else {
                return Err(not_mapped(format!("at {:#x} before address 0", m.start)));
            };
            match base {
                None => base = Some(b),
                Some(prev) if prev == b => {}
                Some(prev) => {
                    return Err(not_mapped(format!(
                        "at two addresses, {prev:#x} and {b:#x}"
                    )))
                }
            }
        }
        base.ok_or_else(|| not_mapped("nowhere".into()))
    }
}

/// Advances per-part progress by `n` bytes transferred over the parts `pending`, in order.
fn advance(done: &mut [usize], pending: &[usize], lens: impl Iterator<Item = usize>, mut n: usize) {
    let lens: Vec<usize> = lens.collect();
    for &i in pending {
        let take = (lens[i] - done[i]).min(n);
        done[i] += take;
        n -= take;
        if n == 0 {
            break;
        }
    }
}

/// One line of `/proc/PID/maps`: `start-end perms offset major:minor inode path`.
#[derive(Debug, PartialEq, Eq)]
struct MapsLine {
    start: u64,
    end: u64,
    shared: bool,
    off: u64,
    dev: u64,
    ino: u64,
}

impl MapsLine {
    fn parse(l: &str) -> Option<MapsLine> {
        let mut f = l.split_whitespace();
        let (s, e) = f.next()?.split_once('-')?;
        let perms = f.next()?;
        let off = u64::from_str_radix(f.next()?, 16).ok()?;
        let (maj, min) = f.next()?.split_once(':')?;
        let ino = f.next()?.parse().ok()?;
        Some(MapsLine {
            start: u64::from_str_radix(s, 16).ok()?,
            end: u64::from_str_radix(e, 16).ok()?,
            shared: perms.as_bytes().get(3) == Some(&b's'),
            off,
            dev: libc::makedev(
                u32::from_str_radix(maj, 16).ok()?,
                u32::from_str_radix(min, 16).ok()?,
            ),
            ino,
        })
    }
}

/// The connected sockets of this process whose local address is the unix socket `path`
/// (the vhost-user connection vhost-user-backend accepted: the crate does not hand its
/// stream out, so it is found among this process's descriptors; memfold-blk serves one
/// connection at a time) and their peer: the one QEMU connected.
///
/// Errors: [`RemoteError::Peer`] (no connection on `path`, or two different peers).
pub fn peer_on_socket(path: &Path) -> Result<Qemu, RemoteError> {
    let peer_err = |what: String| RemoteError::Peer {
        path: path.to_path_buf(),
        what,
    };
    let want = path.as_os_str().as_encoded_bytes();
    let mut found: Option<Qemu> = None;
    let dir =
        std::fs::read_dir("/proc/self/fd").map_err(|e| peer_err(format!("/proc/self/fd: {e}")))?;
    for ent in dir.flatten() {
        let Ok(fd) = ent.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let is_socket = std::fs::read_link(ent.path())
            .is_ok_and(|l| l.as_os_str().as_encoded_bytes().starts_with(b"socket:"));
        if !is_socket {
            continue;
        }
        // SAFETY: fd is open in this process (listed just now) and only borrowed for the
        // calls below; a descriptor closed meanwhile makes them fail with EBADF.
        let b = unsafe { BorrowedFd::borrow_raw(fd) };
        if rustix::net::sockopt::socket_acceptconn(b).unwrap_or(true) {
            continue;
        }
        let Ok(addr) = rustix::net::getsockname(b) else {
            continue;
        };
        let Ok(unix) = rustix::net::SocketAddrUnix::try_from(addr) else {
            continue;
        };
        if unix.path_bytes() != Some(want) {
            continue;
        }
        let q = Qemu::peer_of(b)?;
        match &found {
            Some(prev) if prev.pid != q.pid => {
                return Err(peer_err(format!(
                    "two connections, from pids {} and {}",
                    prev.pid, q.pid
                )))
            }
            Some(_) => {}
            None => found = Some(q),
        }
    }
    found.ok_or_else(|| peer_err("no connection".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn maps_lines_are_read_with_their_device_and_sharing() {
        let l = "7f12a4000000-7f12c4000000 rw-s 40000000 00:01 1234  /memfd:ram0 (deleted)";
        assert_eq!(
            MapsLine::parse(l),
            Some(MapsLine {
                start: 0x7f12a4000000,
                end: 0x7f12c4000000,
                shared: true,
                off: 0x40000000,
                dev: libc::makedev(0, 1),
                ino: 1234
            })
        );
        let p = MapsLine::parse("00400000-00452000 r-xp 00000000 fd:10 99 /bin/x").unwrap();
        assert!(!p.shared);
        assert_eq!(p.dev, libc::makedev(0xfd, 0x10));
        assert_eq!(MapsLine::parse("garbage"), None);
    }

    #[test]
    fn a_file_mapped_in_this_process_is_found_at_its_address() {
        let fd = memfold_sys::memfd::create("maps-test").unwrap();
        memfold_sys::memfd::set_len(fd.as_fd(), 8 << 12).unwrap();
        // SAFETY: a new shared mapping of our own memfd, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4 << 12,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                2 << 12,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let (dev, ino) = memfold_sys::memfd::file_id(fd.as_fd()).unwrap();
        let me = Qemu::open(std::process::id()).unwrap();
        // File byte 3·4096 is the mapping's second page.
        assert_eq!(
            me.file_address(dev, ino, 3 << 12, 4096).unwrap(),
            p as u64 + 4096
        );
        assert_eq!(
            me.file_address(dev, ino, 2 << 12, 4 << 12).unwrap(),
            p as u64
        );
        assert!(matches!(
            me.file_address(dev, ino, 7 << 12, 4096),
            Err(RemoteError::NotMapped { .. })
        ));
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(p, 4 << 12) };
    }

    /// A write holds the agent's write fence over its pages from before its system call
    /// pins them until the copy is done: held here while the copy waits for its source
    /// (a page of this process whose fault the test answers late). Fails if
    /// [`Qemu::write`] stops holding the fence.
    #[test]
    fn a_write_holds_the_write_fence_over_its_pages_until_its_copy_is_done() {
        // This process plays a QEMU whose agent made a fence.
        let agent: &'static WriteFence = Box::leak(Box::new(WriteFence::create().unwrap()));
        let me = std::sync::Arc::new(Qemu::open(std::process::id()).unwrap());
        assert!(me.fenced());
        let target = vec![0u8; 3 * 4096].leak();
        let dst = target.as_ptr() as u64;
        let held = memfold_sys::uffd::HeldPage::new().unwrap();
        let src = held.addr();
        assert!(!agent.busy(dst + 4096));
        let writer = {
            let me = me.clone();
            std::thread::spawn(move || {
                // SAFETY: the source page stays mapped (held outlives the join); its fault
                // is answered below.
                let buf = unsafe { std::slice::from_raw_parts(src as *const u8, 4096) };
                me.write(&[(dst + 4096, buf)])
            })
        };
        assert!(
            held.wait_for_access(std::time::Duration::from_secs(10))
                .unwrap(),
            "the write never faulted"
        );
        assert!(agent.busy(dst + 4096), "held while the copy waits");
        held.release(&[7u8; 4096]).unwrap();
        writer.join().unwrap().unwrap();
        assert!(!agent.busy(dst + 4096), "let go once written");
        assert_eq!(target[4096..8192], [7u8; 4096]);
    }

    #[test]
    fn the_peer_of_an_accepted_connection_is_found_by_the_socket_path() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("v.sock");
        assert!(matches!(
            peer_on_socket(&path),
            Err(RemoteError::Peer { .. })
        ));
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        assert!(
            matches!(peer_on_socket(&path), Err(RemoteError::Peer { .. })),
            "a listener is no connection"
        );
        let _c = std::os::unix::net::UnixStream::connect(&path).unwrap();
        let (_s, _) = l.accept().unwrap();
        let q = peer_on_socket(&path).unwrap();
        assert_eq!(q.pid(), std::process::id());
        assert!(q.alive());
    }

    #[test]
    fn nothing_is_read_or_written_once_the_process_has_exited() {
        let mut c = std::process::Command::new("sleep")
            .arg("0.2")
            .spawn()
            .unwrap();
        let q = Qemu::open(c.id()).unwrap();
        assert!(q.alive());
        c.wait().unwrap();
        assert!(!q.alive());
        let mut b = [0u8; 8];
        assert!(matches!(
            q.read(&mut [(0x1000, &mut b[..])]),
            Err(RemoteError::Gone { .. })
        ));
        assert!(matches!(
            q.write(&[(0x1000, &b[..])]),
            Err(RemoteError::Gone { .. })
        ));
    }
}
