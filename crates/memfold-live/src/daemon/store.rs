//! The store: where the blobs of stashed pages live, packed by the core's [`Slab`].
//!
//! Two kinds: the store memfd (Difference Engine §4.1's storage for patches and
//! compressed pages, host memory) and the swap file (DE §4.6: a file on disk, of a fixed
//! capacity, for pages paged out when the host is over its memory budget).
//!
//! memfoldd writes a blob, then asks the agent to stash the page; the agent holds the
//! store's fd too and reads the blob back on the page's next access, also while memfoldd
//! is down. A chunk (4 KiB) whose slots have all been freed is punched out, so the store
//! uses only the chunks in use (memory for the memfd, disk blocks for the swap file).

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use memfold_core::slab::{Slab, SlabStats, Slot};

use memfold_sys::memfd::{punch_hole, pwrite_all};

/// Why the store could not take a blob, or could not be created.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The swap file is full (its capacity is reached); the page stays in RAM.
    #[error("swap file {path} is full ({capacity} bytes); the page stays in guest RAM")]
    Full {
        /// The swap file.
        path: PathBuf,
        /// Its capacity, bytes.
        capacity: u64,
    },
    /// A system call failed (host out of memory, disk full, ...).
    #[error("{what}: {source}")]
    Io {
        /// The operation and the store.
        what: String,
        /// The cause.
        source: io::Error,
    },
}

/// The store grows 4 MiB at a time (ftruncate; untouched parts use no memory).
const GROW_BYTES: u64 = 4 << 20;

/// A store (memfd or swap file) and its slot books.
pub struct Store {
    fd: OwnedFd,
    slab: Slab,
    size: u64,
    /// The swap file's path and capacity, bytes; `None` for the store memfd.
    swap: Option<(PathBuf, u64)>,
}

impl Store {
    /// A new, empty store memfd.
    ///
    /// Errors: memfd_create failed.
    pub fn create() -> Result<Store, StoreError> {
        // SAFETY: creates a new fd.
        let fd = unsafe { libc::memfd_create(c"memfold-store".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(StoreError::Io {
                what: "store memfd_create".into(),
                source: io::Error::last_os_error(),
            });
        }
        Ok(Store {
            // SAFETY: fresh fd we own.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            slab: Slab::new(),
            size: 0,
            swap: None,
        })
    }

    /// A new, empty swap file at `path` holding at most `capacity` bytes of slots (DE
    /// §4.6). The file is unlinked at once: it lives while memfoldd or an agent holds it,
    /// so no crash leaves it behind.
    ///
    /// Errors: the file cannot be created (missing folder, permissions), or `capacity` is
    /// under one page.
    pub fn swap_file(path: &Path, capacity: u64) -> Result<Store, StoreError> {
        let io_err = |what: &str, source| StoreError::Io {
            what: format!("swap file {}: {what}", path.display()),
            source,
        };
        if capacity < 4096 {
            return Err(io_err(
                "capacity",
                io::Error::other(format!("{capacity} bytes is under one page")),
            ));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| io_err("create", e))?;
        std::fs::remove_file(path).map_err(|e| io_err("unlink", e))?;
        Ok(Store {
            fd: file.into(),
            slab: Slab::new(),
            size: 0,
            swap: Some((path.to_path_buf(), capacity)),
        })
    }

    /// The store's fd (sent to agents).
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Swap file capacity, bytes (`None` for the store memfd).
    pub fn capacity(&self) -> Option<u64> {
        self.swap.as_ref().map(|s| s.1)
    }

    /// Writes `blob` (1..=4096 bytes) into a free slot and returns it.
    ///
    /// Errors: [`StoreError::Full`] when a swap file's capacity is reached;
    /// [`StoreError::Io`] if the length is out of range or growing or writing failed (host
    /// out of memory, disk full). The slot is then free again.
    pub fn put(&mut self, blob: &[u8]) -> Result<Slot, StoreError> {
        let slot = self.slab.alloc(blob.len()).ok_or_else(|| StoreError::Io {
            what: "store slot".into(),
            source: io::Error::other(format!("no slot for a blob of {} bytes", blob.len())),
        })?;
        let end = slot.offset + slot.size as u64;
        if let Some((path, capacity)) = &self.swap {
            if end > *capacity {
                let full = StoreError::Full {
                    path: path.clone(),
                    capacity: *capacity,
                };
                self.free(slot.id);
                return Err(full);
            }
        }
        let written = (|| {
            if end > self.size {
                let size = end.div_ceil(GROW_BYTES) * GROW_BYTES;
                // SAFETY: ftruncate on our fd.
                if unsafe { libc::ftruncate(self.fd.as_raw_fd(), size as libc::off_t) } != 0 {
                    return Err(StoreError::Io {
                        what: "store ftruncate".into(),
                        source: io::Error::last_os_error(),
                    });
                }
                self.size = size;
            }
            pwrite_all(self.fd.as_fd(), blob, slot.offset).map_err(|source| StoreError::Io {
                what: "store pwrite".into(),
                source,
            })
        })();
        if let Err(e) = written {
            self.free(slot.id);
            return Err(e);
        }
        Ok(slot)
    }

    /// Frees slot `id`, punching its chunk out of the memfd if it is now empty.
    pub fn free(&mut self, id: u32) {
        if let Some(off) = self.slab.free(id) {
            // No live slot uses the chunk.
            punch_hole(self.fd.as_fd(), off, 4096);
        }
    }

    /// Occupancy: slots, chunks (4 KiB pages of memory or disk) and slot bytes.
    pub fn stats(&self) -> SlabStats {
        self.slab.stats()
    }

    /// Swap file: writes what was put to disk and drops it from the host's page cache, so
    /// that swapped pages really leave host memory. The store memfd: nothing to do.
    ///
    /// Errors: fdatasync failed (disk error); the blobs stay readable from the cache.
    pub fn write_back(&self) -> io::Result<()> {
        if self.swap.is_none() {
            return Ok(());
        }
        let fd = self.fd.as_raw_fd();
        // SAFETY: plain syscalls on our fd.
        if unsafe { libc::fdatasync(fd) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: as above; advice only.
        unsafe { libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfold_sys::memfd::pread_exact;

    #[test]
    fn blobs_land_where_the_slab_says_and_empty_chunks_are_punched() {
        let mut s = Store::create().unwrap();
        let a = s.put(&[1u8; 100]).unwrap();
        let b = s.put(&[2u8; 3000]).unwrap();
        let mut back = vec![0u8; 100];
        pread_exact(s.fd().as_fd(), &mut back, a.offset).unwrap();
        assert_eq!(back, vec![1u8; 100]);
        let blocks = |s: &Store| {
            std::fs::File::from(s.fd().try_clone().unwrap())
                .metadata()
                .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
                .unwrap()
        };
        assert_eq!(blocks(&s), 8192, "two chunks written");
        s.free(b.id);
        assert_eq!(blocks(&s), 4096, "the emptied chunk is punched");
        assert_eq!(s.stats().chunks, 1);
        assert!(s.put(&[]).is_err());
    }

    #[test]
    fn a_full_swap_file_refuses_blobs_and_takes_them_again_once_freed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("swap");
        let mut s = Store::swap_file(&path, 8192).unwrap();
        assert!(!path.exists(), "unlinked at once");
        assert_eq!(s.capacity(), Some(8192));
        let a = s.put(&[7u8; 4096]).unwrap();
        let _b = s.put(&[8u8; 4096]).unwrap();
        match s.put(&[9u8; 4096]) {
            Err(StoreError::Full { capacity: 8192, .. }) => {}
            other => panic!("expected Full, got {:?}", other.map(|s| s.offset)),
        }
        assert_eq!(s.stats().slots, 2, "the refused slot is free again");
        s.write_back().unwrap();
        let mut back = vec![0u8; 4096];
        pread_exact(s.fd().as_fd(), &mut back, a.offset).unwrap();
        assert_eq!(back, vec![7u8; 4096], "readable after the cache is dropped");
        s.free(a.id);
        let c = s.put(&[9u8; 4096]).unwrap();
        assert_eq!(c.offset, a.offset, "the freed space is reused");
        assert!(Store::swap_file(&dir.path().join("no/such/dir/swap"), 8192).is_err());
    }
}
