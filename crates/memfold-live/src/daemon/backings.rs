//! The engine's backings on real memory and files: the pool and the store are memfds
//! (host memory the agents map or read), the swap file a file on disk (DE §4.6), a
//! guest's RAM QEMU's memfd. Every call is a positional read or write, a hole punched,
//! or an fstat: the engine decides the layout.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use memfold_core::backing::{Backing, BackingError, GuestRam};
use memfold_core::ids::Gfn;
use memfold_sys::memfd;
use memfold_sys::pageout::PageOutWindow;

/// A memfd or file the engine keeps frames or blobs in.
pub struct FileBacking {
    fd: OwnedFd,
    what: &'static str,
    /// A file on disk whose written blocks must leave the page cache (the swap file).
    on_disk: bool,
    /// A read-only window onto the memfd to page frames out through (issue 15), made at
    /// the first page-out and again when the file grew past it.
    window: Option<PageOutWindow>,
    /// The last count of the file's bytes in swap, and when it was taken.
    swapped: std::cell::Cell<Option<(std::time::Instant, u64)>>,
    /// Its length as memfoldd set it (or found it at adoption), bytes. *Invariant: no
    /// walk, window or count goes past it*: agents hold the pool and their store and swap
    /// file read-write and can grow them to any size (`ftruncate`, `fallocate`), and a
    /// walk of what a peer grew would hold memfoldd's one main thread — every guest's —
    /// for as long as the peer likes, and its bytes would count in the host budget.
    len: u64,
    /// Whether a grown file was cut back already (said once in the log).
    trimmed: std::cell::Cell<bool>,
}

/// How old a count of a memfd's bytes in swap may be ([`Backing::swapped_bytes`]).
const SWAPPED_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(2);

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
            window: None,
            swapped: std::cell::Cell::new(None),
            len: 0,
            trimmed: std::cell::Cell::new(false),
        })
    }

    /// An adopted pool memfd (handed back by a re-attaching agent) of `len` bytes, as
    /// memfoldd measured and checked it when it adopted it.
    pub fn adopt(fd: OwnedFd, len: u64) -> FileBacking {
        FileBacking {
            fd,
            what: "pool",
            on_disk: false,
            window: None,
            swapped: std::cell::Cell::new(None),
            len,
            trimmed: std::cell::Cell::new(false),
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
            window: None,
            swapped: std::cell::Cell::new(None),
            len: 0,
            trimmed: std::cell::Cell::new(false),
        })
    }

    /// Cuts the file back to [`FileBacking::len`] if a peer grew it: nothing of memfoldd's
    /// lies past it, and a file left grown would make every count of its allocated bytes
    /// walk its data runs (`memfd::allocated_bytes_within`) — four times a second under a
    /// host budget, as often as the peer grows it again.
    fn trim(&self) {
        let end = self.len.next_multiple_of(4096);
        // Blocks a peer allocated past the end without growing the file
        // (`FALLOC_FL_KEEP_SIZE`) are punched out: they would count, and the size stays.
        // Not on disk, where a file system's own blocks may count past the length.
        let kept = !self.on_disk && memfd::allocated_bytes(self.fd.as_fd()) > end;
        let grown = memfd::size(self.fd.as_fd()).is_ok_and(|s| s > self.len);
        if !kept && !grown {
            return;
        }
        let cut = if grown {
            memfd::set_len(self.fd.as_fd(), self.len).map_err(|e| e.to_string())
        } else {
            Ok(())
        };
        if kept {
            memfd::punch_hole(self.fd.as_fd(), end, u64::MAX / 2 - end);
        }
        if !self.trimmed.replace(true) {
            tracing::warn!(
                "the {} was grown past the {} bytes memfoldd made it (by a QEMU that holds it): cut back ({cut:?})",
                self.what,
                self.len
            );
        }
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
        // Within the length memfoldd set, and within the file as it is: a peer holding it
        // read-write may have cut it short, and zeros read past its end would pass for a
        // frame's or a blob's bytes (a zero page to share onto, a reference to patch
        // against) — the trait's "ran past the end" error, as `MemBacking` gives.
        if offset.saturating_add(out.len() as u64) > self.len {
            return Err(BackingError::new(
                format!(
                    "{} pread of {} bytes at {offset}: past its {} bytes",
                    self.what,
                    out.len(),
                    self.len
                ),
                std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
            ));
        }
        memfd::pread_within(self.fd.as_fd(), out, offset)
            .map_err(|e| BackingError::new(format!("{} pread at {offset}", self.what), e))
    }

    fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), BackingError> {
        // Never past the length it set: a write there would extend the file behind
        // `len`'s back, and the next count's `trim` would cut it off again.
        if offset.saturating_add(bytes.len() as u64) > self.len {
            return Err(BackingError::new(
                format!(
                    "{} pwrite of {} bytes at {offset}: past its {} bytes",
                    self.what,
                    bytes.len(),
                    self.len
                ),
                std::io::Error::from(std::io::ErrorKind::InvalidInput),
            ));
        }
        memfd::pwrite_all(self.fd.as_fd(), bytes, offset)
            .map_err(|e| BackingError::new(format!("{} pwrite at {offset}", self.what), e))
    }

    fn resize(&mut self, bytes: u64) -> Result<(), BackingError> {
        memfd::set_len(self.fd.as_fd(), bytes)
            .map_err(|e| BackingError::new(format!("{} ftruncate to {bytes}", self.what), e))?;
        self.len = bytes;
        Ok(())
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
        self.trim();
        memfd::allocated_bytes_within(self.fd.as_fd(), self.len)
            .min(self.len.next_multiple_of(4096))
    }

    fn page_out(&mut self, pages: &[u64]) -> Result<u64, BackingError> {
        if self.on_disk {
            // The swap file's pages are on disk already.
            return Ok(0);
        }
        let what = self.what;
        let err = |e| BackingError::new(format!("{what} page-out"), e);
        self.trim();
        let size = memfd::size(self.fd.as_fd()).map_err(err)?.min(self.len) / 4096;
        if size > 0 && self.window.as_ref().is_none_or(|w| w.pages() < size) {
            self.window = None;
            self.window = Some(PageOutWindow::new(self.fd.as_fd(), size * 4096).map_err(err)?);
        }
        let Some(w) = self.window.as_ref() else {
            return Ok(0);
        };
        let inside: Vec<u64> = pages.iter().copied().filter(|&p| p < w.pages()).collect();
        let (left, result) = w.page_out_list(&inside);
        self.swapped.set(None);
        result.map_err(err)?;
        Ok(left.into_iter().filter(|&l| l).count() as u64)
    }

    fn swapped_bytes(&self) -> u64 {
        if self.on_disk {
            return 0;
        }
        // Asked of the kernel (a window made for the count: after a restart the adopted
        // pool may hold frames the last memfoldd paged out), at most every
        // SWAPPED_MAX_AGE: the books and the budget ask several times a second, and the
        // count walks the whole file.
        if let Some((at, bytes)) = self.swapped.get() {
            if at.elapsed() < SWAPPED_MAX_AGE {
                return bytes;
            }
        }
        self.trim();
        let bytes = memfold_sys::pageout::swapped_bytes(self.fd.as_fd(), self.len).unwrap_or(0);
        self.swapped.set(Some((std::time::Instant::now(), bytes)));
        bytes
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that holds a backing read-write cuts it short: a read of what it cut is an
    /// error, not a page of zeros (the engine would take it for a zero frame to share
    /// onto, or a reference to patch against); so is a read past the length memfoldd set.
    #[test]
    fn a_backing_cut_short_by_its_peer_reads_as_an_error_not_zeros() {
        let mut b = FileBacking::memfd("cut-test").unwrap();
        b.resize(8 * 4096).unwrap();
        b.write(4096, &[5u8; 4096]).unwrap();
        let mut page = [0u8; 4096];
        b.read(4096, &mut page).unwrap();
        assert_eq!(page, [5u8; 4096]);
        let peer = b.dup().unwrap();
        memfd::set_len(peer.as_fd(), 4096).unwrap();
        let err = b.read(4096, &mut page).unwrap_err();
        assert!(err.to_string().contains("pread at 4096"), "{err}");
        memfd::set_len(peer.as_fd(), 16 * 4096).unwrap();
        let err = b.read(8 * 4096, &mut page).unwrap_err();
        assert!(err.to_string().contains("past its 32768 bytes"), "{err}");
    }

    /// A peer that holds a backing read-write grows it to 1 TiB (sparse): the page-out
    /// window, the count of bytes in swap and the allocated bytes stay within the length
    /// memfoldd set. (Before, the window and the `mincore` walk covered the whole TiB —
    /// 2^28 page lookups on memfoldd's main thread for each count.)
    #[test]
    fn a_backing_grown_by_its_peer_is_walked_and_counted_only_as_far_as_memfoldd_set_it() {
        let mut b = FileBacking::memfd("grown-test").unwrap();
        b.resize(8 * 4096).unwrap();
        b.write(0, &[5u8; 4096]).unwrap();
        let peer = b.dup().unwrap();
        memfd::set_len(peer.as_fd(), 1 << 40).unwrap();
        memfd::pwrite_all(peer.as_fd(), &[6u8; 4096], (1 << 40) - 4096).unwrap();
        assert_eq!(
            b.allocated_bytes(),
            4096,
            "the peer's page past the length counts"
        );
        // Cut back: no later count walks what the peer grew.
        assert_eq!(memfd::size(peer.as_fd()).unwrap(), 8 * 4096);
        memfd::set_len(peer.as_fd(), 1 << 40).unwrap();
        assert_eq!(b.swapped_bytes(), 0);
        b.page_out(&[0, 1 << 27]).unwrap();
        let window = b.window.as_ref().map(|w| w.pages());
        assert_eq!(
            window,
            Some(8),
            "the page-out window covers what the peer grew"
        );
        let mut page = [0u8; 4096];
        b.read(0, &mut page).unwrap();
        assert!(page.iter().all(|&x| x == 5));
        // Blocks allocated past the end without growing the file are punched out.
        use std::os::fd::AsRawFd;
        // SAFETY: fallocate on a descriptor this test owns; no memory is passed.
        let r = unsafe {
            libc::fallocate(
                peer.as_raw_fd(),
                libc::FALLOC_FL_KEEP_SIZE,
                8 * 4096,
                16 << 20,
            )
        };
        assert_eq!(r, 0);
        assert_eq!(b.allocated_bytes(), 4096, "blocks kept past the end count");
        assert!(memfd::allocated_bytes(peer.as_fd()) <= 8 * 4096);
        // memfoldd's own write past its length is refused, not cut off later.
        assert!(b.write(8 * 4096, &[9u8; 4096]).is_err());
        assert_eq!(memfd::size(peer.as_fd()).unwrap(), 8 * 4096);
    }
}
