//! The engine's backings on real memory and files: the pool and the store are memfds
//! (host memory the agents map or read), the swap file a file on disk (DE §4.6), a
//! guest's RAM QEMU's memfd. Every call is a positional read or write, a hole punched,
//! or an fstat: the engine decides the layout.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use memfold_core::backing::{Backing, BackingError, GuestRam};
use memfold_core::ids::Gfn;
use memfold_sys::memfd;

/// A memfd or file the engine keeps frames or blobs in.
pub struct FileBacking {
    fd: OwnedFd,
    what: &'static str,
    /// A file on disk whose written blocks must leave the page cache (the swap file).
    on_disk: bool,
}

impl FileBacking {
    /// A new, empty memfd named `memfold-<what>` (a domain's pool, a guest's store).
    ///
    /// Errors: memfd_create failed.
    pub fn memfd(what: &'static str) -> Result<FileBacking, BackingError> {
        let fd = memfd::create(&format!("memfold-{what}"))
            .map_err(|e| BackingError::new(format!("{what} memfd_create"), e))?;
        Ok(FileBacking {
            fd,
            what,
            on_disk: false,
        })
    }

    /// An adopted pool memfd (handed back by a re-attaching agent).
    pub fn adopt(fd: OwnedFd) -> FileBacking {
        FileBacking {
            fd,
            what: "pool",
            on_disk: false,
        }
    }

    /// A new swap file in folder `dir`, unnamed and mode 0600 (`O_TMPFILE`): it lives
    /// while memfoldd or the guest's agent holds it, no other process can open it, and no
    /// crash leaves it behind. One per guest, so a QEMU reads no other guest's swapped
    /// pages.
    ///
    /// Errors: the folder is missing or unwritable, or its file system lacks `O_TMPFILE`.
    pub fn swap_file(dir: &Path) -> Result<FileBacking, BackingError> {
        let fd = memfd::tmpfile(dir).map_err(|e| {
            BackingError::new(format!("swap file in {}: O_TMPFILE", dir.display()), e)
        })?;
        Ok(FileBacking {
            fd,
            what: "swap file",
            on_disk: true,
        })
    }

    /// A second descriptor of the same memfd or file (to hand to agents).
    ///
    /// Errors: out of descriptors.
    pub fn dup(&self) -> std::io::Result<OwnedFd> {
        self.fd.try_clone()
    }
}

impl AsFd for FileBacking {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Backing for FileBacking {
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BackingError> {
        memfd::pread_exact(self.fd.as_fd(), out, offset)
            .map_err(|e| BackingError::new(format!("{} pread at {offset}", self.what), e))
    }

    fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), BackingError> {
        memfd::pwrite_all(self.fd.as_fd(), bytes, offset)
            .map_err(|e| BackingError::new(format!("{} pwrite at {offset}", self.what), e))
    }

    fn resize(&mut self, bytes: u64) -> Result<(), BackingError> {
        memfd::set_len(self.fd.as_fd(), bytes)
            .map_err(|e| BackingError::new(format!("{} ftruncate to {bytes}", self.what), e))
    }

    fn release(&mut self, offset: u64, len: u64) {
        // Failing to punch only keeps the memory.
        memfd::punch_hole(self.fd.as_fd(), offset, len);
    }

    fn sync(&mut self) -> Result<(), BackingError> {
        if !self.on_disk {
            return Ok(());
        }
        memfd::sync_data(self.fd.as_fd())
            .map_err(|e| BackingError::new(format!("{} fdatasync", self.what), e))?;
        memfd::drop_cache(self.fd.as_fd(), 0, 0);
        Ok(())
    }

    fn allocated_bytes(&self) -> u64 {
        memfd::allocated_bytes(self.fd.as_fd())
    }
}

/// A guest's RAM: QEMU's memfd, read with pread (nothing is faulted in).
pub struct MemfdRam {
    fd: OwnedFd,
}

impl MemfdRam {
    /// Guest RAM in memfd `fd`.
    pub fn new(fd: OwnedFd) -> MemfdRam {
        MemfdRam { fd }
    }
}

impl GuestRam for MemfdRam {
    fn read(&self, first: Gfn, out: &mut [u8]) -> Result<(), BackingError> {
        memfd::pread_exact(self.fd.as_fd(), out, first.offset())
            .map_err(|e| BackingError::new(format!("guest RAM pread at {first}"), e))
    }

    fn next_data_run(&self, from: Gfn, end: Gfn) -> Option<(Gfn, Gfn)> {
        memfd::next_data_run(self.fd.as_fd(), from, end)
    }

    fn allocated_bytes(&self) -> u64 {
        memfd::allocated_bytes(self.fd.as_fd())
    }
}
