//! The store: one memfd holding the blobs of stashed pages (Difference Engine §4.1's
//! storage for patches and compressed pages), packed by the core's [`Slab`].
//!
//! memfoldd writes a blob, then asks the agent to stash the page; the agent holds the
//! store memfd too and reads the blob back on the page's next access, also while
//! memfoldd is down. A chunk (4 KiB of the memfd) whose slots have all been freed is
//! punched out, so the store's host memory is the chunks in use.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use memfold_core::slab::{Slab, SlabStats, Slot};

use super::pool::PoolError;
use crate::io_util::pwrite_all;

/// The store grows 4 MiB at a time (ftruncate; untouched parts use no memory).
const GROW_BYTES: u64 = 4 << 20;

/// The store memfd and its slot books.
pub struct Store {
    fd: OwnedFd,
    slab: Slab,
    size: u64,
}

impl Store {
    /// A new, empty store memfd.
    ///
    /// Errors: memfd_create failed.
    pub fn create() -> Result<Store, PoolError> {
        // SAFETY: creates a new fd.
        let fd = unsafe { libc::memfd_create(c"memfold-store".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(PoolError::Io {
                what: "store memfd_create",
                source: io::Error::last_os_error(),
            });
        }
        Ok(Store {
            // SAFETY: fresh fd we own.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            slab: Slab::new(),
            size: 0,
        })
    }

    /// The store memfd (sent to agents).
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Writes `blob` (1..=4096 bytes) into a free slot and returns it.
    ///
    /// Errors: the length is out of range, or growing or writing the memfd failed (host
    /// out of memory); the slot is then free again.
    pub fn put(&mut self, blob: &[u8]) -> Result<Slot, PoolError> {
        let slot = self.slab.alloc(blob.len()).ok_or_else(|| PoolError::Io {
            what: "store slot",
            source: io::Error::other(format!("no slot for a blob of {} bytes", blob.len())),
        })?;
        let end = slot.offset + slot.size as u64;
        let written = (|| {
            if end > self.size {
                let size = end.div_ceil(GROW_BYTES) * GROW_BYTES;
                // SAFETY: ftruncate on our fd.
                if unsafe { libc::ftruncate(self.fd.as_raw_fd(), size as libc::off_t) } != 0 {
                    return Err(PoolError::Io {
                        what: "store ftruncate",
                        source: io::Error::last_os_error(),
                    });
                }
                self.size = size;
            }
            pwrite_all(self.fd.as_raw_fd(), blob, slot.offset).map_err(|source| PoolError::Io {
                what: "store pwrite",
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
            // SAFETY: punches a chunk no live slot uses; failure only keeps the memory.
            unsafe {
                libc::fallocate(
                    self.fd.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    off as libc::off_t,
                    4096,
                )
            };
        }
    }

    /// Occupancy: slots, chunks (pages of host memory) and slot bytes.
    pub fn stats(&self) -> SlabStats {
        self.slab.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io_util::pread_exact;

    #[test]
    fn blobs_land_where_the_slab_says_and_empty_chunks_are_punched() {
        let mut s = Store::create().unwrap();
        let a = s.put(&[1u8; 100]).unwrap();
        let b = s.put(&[2u8; 3000]).unwrap();
        let mut back = vec![0u8; 100];
        pread_exact(s.fd().as_raw_fd(), &mut back, a.offset).unwrap();
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
}
