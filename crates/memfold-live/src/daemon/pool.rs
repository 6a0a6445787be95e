//! The pool: one memfd holding every shared frame (ESX §4.3's shared machine pages).
//!
//! Frame `f` is bytes `[f·4096, (f+1)·4096)` of the pool memfd, which every agent maps
//! read-only (write-protected) over the guest pages that share it. Reference counts say
//! how many guest pages map a frame; `pending` how many share requests name it and are
//! not answered yet. A frame is freed (its bytes punched out of the memfd) when both are 0.
//!
//! Allocation keeps neighbours together: the frame after the last one allocated is
//! preferred, so runs of equal pages in two guests map onto runs of frames and their
//! mappings merge into one VMA each.

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use memfold_sys::memfd::{pread_exact, punch_hole, pwrite_all};

const PAGE: u64 = 4096;
/// The pool grows 4 MiB at a time (ftruncate; untouched parts use no memory).
const GROW_FRAMES: u32 = 1024;

/// Pool errors.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// A system call on the pool memfd failed.
    #[error("pool memfd: {what}: {source}")]
    Io {
        /// The operation.
        what: &'static str,
        /// The cause.
        source: io::Error,
    },
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> PoolError {
    move |source| PoolError::Io { what, source }
}

/// The pool memfd and its frames' books.
pub struct Pool {
    fd: OwnedFd,
    refcount: Vec<u32>,
    pending: Vec<u32>,
    /// Content hash of each frame in use (to remove it from the share table when freed).
    hash: Vec<u64>,
    free: BTreeSet<u32>,
    /// Frames the memfd holds. After adoption all of them count as taken (a guest not yet
    /// re-attached may map any): only frames freed through this daemon's books are reused.
    size_frames: u32,
    next: u32,
    last: Option<u32>,
    in_use: u32,
}

impl Pool {
    /// A new, empty pool memfd.
    ///
    /// Errors: memfd_create failed.
    pub fn create() -> Result<Pool, PoolError> {
        // SAFETY: creates a new fd.
        let fd = unsafe { libc::memfd_create(c"memfold-pool".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io_err("memfd_create")(io::Error::last_os_error()));
        }
        // SAFETY: fresh fd we own.
        Ok(Self::with_fd(unsafe { OwnedFd::from_raw_fd(fd) }, 0))
    }

    /// Adopts the pool of a previous memfoldd (handed back by a re-attaching agent). Its
    /// frames are all treated as in use until their references drop through this daemon.
    ///
    /// Errors: the descriptor cannot be stat'ed.
    pub fn adopt(fd: OwnedFd) -> Result<Pool, PoolError> {
        let len = std::fs::File::from(fd.try_clone().map_err(io_err("dup"))?)
            .metadata()
            .map_err(io_err("fstat"))?
            .len();
        let frames = (len / PAGE) as u32;
        let mut p = Self::with_fd(fd, frames);
        p.next = frames;
        Ok(p)
    }

    fn with_fd(fd: OwnedFd, frames: u32) -> Pool {
        Pool {
            fd,
            refcount: vec![0; frames as usize],
            pending: vec![0; frames as usize],
            hash: vec![0; frames as usize],
            free: BTreeSet::new(),
            size_frames: frames,
            next: 0,
            last: None,
            in_use: 0,
        }
    }

    /// The pool memfd (sent to agents).
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Whether `fd` is this pool (same inode).
    pub fn is(&self, other: &OwnedFd) -> bool {
        use std::os::unix::fs::MetadataExt;
        let id = |f: &OwnedFd| {
            f.try_clone()
                .ok()
                .and_then(|d| std::fs::File::from(d).metadata().ok())
                .map(|m| (m.dev(), m.ino()))
        };
        let mine = id(&self.fd);
        mine.is_some() && mine == id(other)
    }

    /// Frames holding content (mapped, pending or adopted).
    pub fn in_use(&self) -> u32 {
        self.in_use
    }

    /// Allocates a frame holding `page`, with `pending` = 1 and no references.
    ///
    /// Errors: growing or writing the memfd failed (host out of memory).
    pub fn alloc(&mut self, page: &[u8], hash: u64) -> Result<u32, PoolError> {
        let preferred = self.last.map(|l| l + 1).filter(|n| self.free.contains(n));
        let f = if let Some(n) = preferred {
            self.free.remove(&n);
            n
        } else if self.next < self.size_frames {
            self.next += 1;
            self.next - 1
        } else if let Some(n) = self.free.pop_first() {
            n
        } else {
            let size = self.size_frames + GROW_FRAMES;
            // SAFETY: ftruncate on our fd.
            if unsafe { libc::ftruncate(self.fd.as_raw_fd(), size as i64 * PAGE as i64) } != 0 {
                return Err(io_err("ftruncate")(io::Error::last_os_error()));
            }
            self.size_frames = size;
            self.refcount.resize(size as usize, 0);
            self.pending.resize(size as usize, 0);
            self.hash.resize(size as usize, 0);
            self.next += 1;
            self.next - 1
        };
        pwrite_all(self.fd.as_fd(), page, f as u64 * PAGE).map_err(io_err("pwrite"))?;
        self.last = Some(f);
        self.pending[f as usize] = 1;
        self.hash[f as usize] = hash;
        self.in_use += 1;
        Ok(f)
    }

    /// Marks an adopted frame as in use with a known content hash.
    pub fn adopt_frame(&mut self, f: u32, hash: u64) {
        if self.refcount[f as usize] == 0 && self.pending[f as usize] == 0 {
            self.in_use += 1;
        }
        self.hash[f as usize] = hash;
    }

    /// Number of frames the memfd can hold.
    pub fn size_frames(&self) -> u32 {
        self.size_frames
    }

    /// Reads frame `f`.
    ///
    /// Errors: pread failed.
    pub fn read(&self, f: u32, out: &mut [u8]) -> Result<(), PoolError> {
        pread_exact(self.fd.as_fd(), out, f as u64 * PAGE).map_err(io_err("pread"))
    }

    /// Content hash recorded for frame `f`.
    pub fn hash(&self, f: u32) -> u64 {
        self.hash[f as usize]
    }

    /// References to frame `f` (guest pages mapped onto it).
    pub fn refcount(&self, f: u32) -> u32 {
        self.refcount[f as usize]
    }

    /// One more share request names `f`.
    pub fn add_pending(&mut self, f: u32) {
        self.pending[f as usize] += 1;
    }

    /// A share request naming `f` was answered: `mapped` says whether the page now maps
    /// it. Returns true if the frame was freed.
    pub fn answer(&mut self, f: u32, mapped: bool) -> bool {
        self.pending[f as usize] -= 1;
        if mapped {
            self.refcount[f as usize] += 1;
        }
        self.maybe_free(f)
    }

    /// Adds a reference (an adopted mapping).
    pub fn incref(&mut self, f: u32) {
        self.refcount[f as usize] += 1;
    }

    /// Drops a reference (a CoW break). Returns true if the frame was freed.
    pub fn decref(&mut self, f: u32) -> bool {
        let r = &mut self.refcount[f as usize];
        *r = r.saturating_sub(1);
        self.maybe_free(f)
    }

    fn maybe_free(&mut self, f: u32) -> bool {
        if self.refcount[f as usize] != 0 || self.pending[f as usize] != 0 {
            return false;
        }
        // No guest maps this frame any more.
        punch_hole(self.fd.as_fd(), f as u64 * PAGE, PAGE);
        self.free.insert(f);
        self.in_use -= 1;
        true
    }
}
