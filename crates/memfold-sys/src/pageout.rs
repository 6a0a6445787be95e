//! Sending pages of a memfd to the kernel's swap (zswap when the host has it on) with
//! `MADV_PAGEOUT` (issue 15: memfold the policy, the kernel the mechanism; docs/peer.md,
//! "A zswap backing").
//!
//! `MADV_PAGEOUT` acts on the calling process's page tables and takes a page only if
//! exactly one mapping maps it. The agent's clock zaps a page's PTE in QEMU's mapping
//! when it arms it (and a page the clock found cold stayed unmapped since), so paging out
//! through QEMU's own mapping would find nothing to take. A [`PageOutWindow`] is a
//! second, read-only mapping of the memfd, registered with nothing: a page read through
//! it is mapped there alone, paged out, and the window's PTE dropped again. A page QEMU
//! (or another process: a block device) maps too is left in RAM — it is in use.
//!
//! Nothing here changes a byte of the file: the window is read-only, `MADV_PAGEOUT` keeps
//! a page's bytes (in zswap or the swap file, the page cache naming the swap entry), and
//! `MADV_DONTNEED` on a shared file mapping only drops PTEs. A page punched to a hole
//! between the residency check and the read through the window comes back as a zero
//! page, which is what the hole read as.

use std::io;
use std::os::fd::BorrowedFd;

/// Bytes in a page.
const PAGE: usize = 4096;

/// The kernel's fault-around block, pages (`fault_around_bytes`, 64 KiB by default): a
/// read fault through the window may map the cached pages of its whole block.
struct FaultAround(u64);

const FAULT_AROUND: FaultAround = FaultAround(16);

impl FaultAround {
    /// Pages `[first, first + n)` rounded out to whole blocks, within `[0, pages)`.
    fn span(&self, first: u64, n: u64, pages: u64) -> (u64, u64) {
        let lo = first / self.0 * self.0;
        let hi = (first + n).div_ceil(self.0) * self.0;
        (lo, hi.min(pages))
    }
}

/// A read-only shared mapping of a whole memfd, to page its pages out from
/// ([module docs](self)).
pub struct PageOutWindow {
    addr: *mut u8,
    len: usize,
}

// SAFETY: the window is only read through raw pointers for their side effect (a PTE),
// and the kernel calls on it take no lock of ours; any thread may use it.
unsafe impl Send for PageOutWindow {}

impl PageOutWindow {
    /// Maps `len` bytes (whole pages) of `fd` from offset 0, read-only, shared.
    ///
    /// Errors: `len` is 0 or not whole pages; the mapping failed (ENOMEM: address space).
    pub fn new(fd: BorrowedFd<'_>, len: u64) -> io::Result<PageOutWindow> {
        if len == 0 || len % PAGE as u64 != 0 {
            return Err(io::Error::other(format!(
                "a page-out window of {len} bytes: not whole pages"
            )));
        }
        let len = len as usize;
        use rustix::mm::{MapFlags, ProtFlags};
        // SAFETY: a new mapping at an address the kernel picks, overlapping nothing of
        // this process; it is only read through raw pointers of this module.
        let addr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ,
                MapFlags::SHARED,
                fd,
                0,
            )
        }?;
        Ok(PageOutWindow {
            addr: addr.cast(),
            len,
        })
    }

    /// Pages in the window.
    pub fn pages(&self) -> u64 {
        (self.len / PAGE) as u64
    }

    /// Whether each of the `n` pages from page `first` is in RAM now (`mincore`: the
    /// page cache, or the swap cache for a page on its way in or out), one bool a page.
    ///
    /// Errors: the range is past the window; `mincore` failed.
    pub fn resident(&self, first: u64, n: u64) -> io::Result<Vec<bool>> {
        let (start, len) = self.range(first, n)?;
        let mut v = vec![0u8; n as usize];
        // SAFETY: the range is inside this mapping; `v` has a byte per page of it.
        let rc = unsafe { libc::mincore(start.cast(), len, v.as_mut_ptr()) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(v.iter().map(|b| b & 1 != 0).collect())
    }

    /// Pages out the pages of `[first, first + n)` for which `take` is true and that are
    /// in RAM: maps each run of them through the window, `MADV_PAGEOUT` on the run (twice:
    /// a page on a per-CPU LRU list is skipped the first time), then drops the window's
    /// PTEs. Returns, a
    /// bool a page, which of the taken pages left RAM; a page another mapping maps, or
    /// with no swap to go to, stays.
    ///
    /// Errors: the range is past the window; `mincore` or `madvise` failed (the pages
    /// keep their bytes wherever they are).
    pub fn page_out(&self, first: u64, n: u64, take: &[bool]) -> io::Result<Vec<bool>> {
        let (start, _) = self.range(first, n)?;
        let before = self.resident(first, n)?;
        let taken = |k: usize| before[k] && take.get(k).copied().unwrap_or(false);
        // Runs of taken pages, each mapped through the window and paged out on its own:
        // the read fault maps untaken neighbours too (the kernel's fault-around, 16 pages
        // here), which a page-out over the whole span would take as well.
        let mut runs = Vec::new();
        let mut k = 0;
        while k < n as usize {
            if !taken(k) {
                k += 1;
                continue;
            }
            let mut e = k + 1;
            while e < n as usize && taken(e) {
                e += 1;
            }
            runs.push((k, e));
            k = e;
        }
        if runs.is_empty() {
            return Ok(vec![false; n as usize]);
        }
        let advise = |from: usize, to: usize, a: rustix::mm::Advice| {
            // SAFETY: advice on pages [from, to) of the span, inside this mapping (checked
            // by `range`); neither piece of advice used here changes the file's bytes
            // (module docs).
            unsafe { rustix::mm::madvise(start.add(from * PAGE).cast(), (to - from) * PAGE, a) }
                .map_err(io::Error::from)
        };
        let mut out = Ok(());
        for &(a, b) in &runs {
            out = out
                .and_then(|()| self.map_in(first + a as u64, (b - a) as u64))
                .and_then(|()| advise(a, b, rustix::mm::Advice::LinuxPageOut))
                .and_then(|()| advise(a, b, rustix::mm::Advice::LinuxPageOut));
        }
        // The window's PTEs go in any case, fault-around's included (the span rounded out
        // to its 64 KiB blocks): a page the window kept mapped would count as mapped twice
        // and never be paged out again.
        let (lo, hi) = FAULT_AROUND.span(first, n, self.pages());
        // SAFETY: as `advise`, over pages [lo, hi) of the window (inside it by `span`).
        unsafe {
            rustix::mm::madvise(
                self.addr.add(lo as usize * PAGE).cast(),
                (hi - lo) as usize * PAGE,
                rustix::mm::Advice::LinuxDontNeed,
            )
        }?;
        out?;
        let after = self.resident(first, n)?;
        Ok((0..n as usize).map(|k| taken(k) && !after[k]).collect())
    }

    /// Maps pages `[first, first + n)` through the window as a read would, so that the
    /// window maps them alone. A page the file no longer has (a peer holding it truncated
    /// it since `mincore`) is an error, where a read would be SIGBUS: memfoldd down for
    /// every guest.
    ///
    /// Errors: the range is past the window; `MADV_POPULATE_READ` failed (EFAULT: past
    /// the file's end).
    fn map_in(&self, first: u64, n: u64) -> io::Result<()> {
        let (start, len) = self.range(first, n)?;
        // SAFETY: inside the mapping (checked by `range`); populating a read-only shared
        // mapping changes no byte of the file.
        unsafe { rustix::mm::madvise(start.cast(), len, rustix::mm::Advice::LinuxPopulateRead) }?;
        Ok(())
    }

    /// [`PageOutWindow::page_out`] over a list of pages (page indices, ascending), one
    /// call per span of at most 64 pages with the pages between left untaken (the kernel
    /// walks a span's page tables once). Returns, a bool per listed page, which left RAM,
    /// and the first error: a span that failed counts as nothing left, and the spans after
    /// it are still tried (what left before stays known).
    ///
    /// Errors: the list is not ascending (nothing tried); a page is past the window, or
    /// `mincore` or `madvise` failed (the pages keep their bytes wherever they are).
    pub fn page_out_list(&self, pages: &[u64]) -> (Vec<bool>, io::Result<()>) {
        if pages.windows(2).any(|w| w[0] >= w[1]) {
            return (
                vec![false; pages.len()],
                Err(io::Error::other(
                    "pages to page out are not in ascending order",
                )),
            );
        }
        let mut first_err = Ok(());
        let mut left = Vec::with_capacity(pages.len());
        let mut i = 0;
        while i < pages.len() {
            let p0 = pages[i];
            let mut j = i + 1;
            while j < pages.len() && pages[j] - p0 < 64 {
                j += 1;
            }
            let span = pages[j - 1] - p0 + 1;
            let mut take = vec![false; span as usize];
            for p in &pages[i..j] {
                take[(p - p0) as usize] = true;
            }
            match self.page_out(p0, span, &take) {
                Ok(out) => left.extend(pages[i..j].iter().map(|p| out[(p - p0) as usize])),
                Err(e) => {
                    left.extend(std::iter::repeat_n(false, j - i));
                    if first_err.is_ok() {
                        first_err = Err(e);
                    }
                }
            }
            i = j;
        }
        (left, first_err)
    }

    /// Pages of the window in RAM now (the page cache or the swap cache), counted a
    /// 64 Ki-page chunk at a time.
    ///
    /// Errors: `mincore` failed.
    pub fn resident_pages(&self) -> io::Result<u64> {
        let mut n = 0;
        let mut first = 0;
        while first < self.pages() {
            let len = (self.pages() - first).min(1 << 16);
            n += self.resident(first, len)?.iter().filter(|&&r| r).count() as u64;
            first += len;
        }
        Ok(n)
    }

    /// The window's address and length for pages `[first, first + n)`.
    fn range(&self, first: u64, n: u64) -> io::Result<(*mut u8, usize)> {
        match first.checked_add(n) {
            Some(end) if n > 0 && end <= self.pages() => {
                // SAFETY: `first` pages into the mapping (checked just above).
                Ok((
                    unsafe { self.addr.add(first as usize * PAGE) },
                    n as usize * PAGE,
                ))
            }
            _ => Err(io::Error::other(format!(
                "pages [{first}, {first} + {n}) are past a page-out window of {} pages",
                self.pages()
            ))),
        }
    }
}

/// Bytes of memfd (or other shmem file) `fd` in the kernel's swap now: its allocated
/// bytes less those in RAM (`mincore` through a read-only window made for the count; a
/// swapped-out page is allocated to the file but in neither the page cache nor the swap
/// cache). 0 for an empty file. The two are read one after the other and `mincore` walks
/// the file while pages move, so under churn the figure is approximate.
///
/// Only the first `max_len` bytes are walked, and allocated bytes past them are not
/// counted: a peer that holds the file read-write (an agent, its domain's pool) can grow
/// it to any size, and the walk — one page-cache lookup a page — would then hold the
/// caller for minutes.
///
/// Errors: the file's size cannot be read, or the window cannot be made or read.
pub fn swapped_bytes(fd: BorrowedFd<'_>, max_len: u64) -> io::Result<u64> {
    let size = crate::memfd::size(fd)?.min(max_len) / PAGE as u64 * PAGE as u64;
    if size == 0 {
        return Ok(0);
    }
    let allocated = crate::memfd::allocated_bytes_within(fd, size);
    let resident = PageOutWindow::new(fd, size)?.resident_pages()? * PAGE as u64;
    Ok(allocated.saturating_sub(resident))
}

impl Drop for PageOutWindow {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once; nothing points into it after.
        let _ = unsafe { rustix::mm::munmap(self.addr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_window_refuses_ranges_past_its_end_and_pages_nothing_it_is_not_told_to() {
        let fd = crate::memfd::create("pageout-test").unwrap();
        crate::memfd::set_len(fd.as_fd(), 8 * PAGE as u64).unwrap();
        crate::memfd::pwrite_all(fd.as_fd(), &[7u8; 8 * PAGE], 0).unwrap();
        let w = PageOutWindow::new(fd.as_fd(), 8 * PAGE as u64).unwrap();
        assert!(w.resident(7, 2).is_err());
        assert!(w.page_out(8, 1, &[true]).is_err());
        assert_eq!(w.resident(0, 8).unwrap(), vec![true; 8]);
        // Told to take nothing: nothing leaves, with or without swap on the host.
        assert_eq!(w.page_out(0, 8, &[false; 8]).unwrap(), vec![false; 8]);
        assert_eq!(w.resident(0, 8).unwrap(), vec![true; 8]);
        let mut b = [0u8; 8 * PAGE];
        crate::memfd::pread_exact(fd.as_fd(), &mut b, 0).unwrap();
        assert!(b.iter().all(|&x| x == 7));
        assert!(PageOutWindow::new(fd.as_fd(), 100).is_err());
    }

    #[test]
    fn a_page_list_must_ascend_and_a_file_all_in_ram_has_nothing_swapped() {
        let fd = crate::memfd::create("pageout-list-test").unwrap();
        assert_eq!(
            swapped_bytes(fd.as_fd(), u64::MAX).unwrap(),
            0,
            "an empty file"
        );
        crate::memfd::set_len(fd.as_fd(), 200 * PAGE as u64).unwrap();
        crate::memfd::pwrite_all(fd.as_fd(), &[3u8; 2 * PAGE], 0).unwrap();
        crate::memfd::pwrite_all(fd.as_fd(), &[4u8; PAGE], 150 * PAGE as u64).unwrap();
        let w = PageOutWindow::new(fd.as_fd(), 200 * PAGE as u64).unwrap();
        assert_eq!(w.resident_pages().unwrap(), 3);
        assert_eq!(swapped_bytes(fd.as_fd(), u64::MAX).unwrap(), 0);
        // A page past max_len is neither walked nor counted (as in swap, were it
        // allocated and not found resident by the walk).
        assert_eq!(swapped_bytes(fd.as_fd(), 100 * PAGE as u64).unwrap(), 0);
        assert_eq!(
            crate::memfd::allocated_bytes_within(fd.as_fd(), 100 * PAGE as u64),
            2 * PAGE as u64
        );
        assert!(w.page_out_list(&[1, 0]).1.is_err());
        assert!(w.page_out_list(&[1, 1]).1.is_err());
        // A span past the window fails; the ones before it are still answered.
        let (left, r) = w.page_out_list(&[5, 200]);
        assert!(r.is_err());
        assert_eq!(left.len(), 2);
        // Holes never leave (nothing there); what leaves depends on the host's swap, but
        // the bytes never change.
        let (left, r) = w.page_out_list(&[5, 70, 199]);
        r.unwrap();
        assert_eq!(left, vec![false; 3]);
        w.page_out_list(&[0, 1, 150]).1.unwrap();
        let mut b = [0u8; PAGE];
        crate::memfd::pread_exact(fd.as_fd(), &mut b, 150 * PAGE as u64).unwrap();
        assert!(b.iter().all(|&x| x == 4));
    }

    /// A file truncated under the window (a QEMU holds the pool read-write): mapping its
    /// lost pages is an error, not SIGBUS. Seen killing the test process with `map_in`
    /// reading a byte a page.
    #[test]
    fn pages_a_truncation_took_are_an_error_not_a_signal() {
        let fd = crate::memfd::create("pageout-truncated").unwrap();
        crate::memfd::set_len(fd.as_fd(), 8 * PAGE as u64).unwrap();
        crate::memfd::pwrite_all(fd.as_fd(), &[7u8; 8 * PAGE], 0).unwrap();
        let w = PageOutWindow::new(fd.as_fd(), 8 * PAGE as u64).unwrap();
        crate::memfd::set_len(fd.as_fd(), 2 * PAGE as u64).unwrap();
        assert!(w.map_in(0, 2).is_ok());
        assert!(w.map_in(4, 4).is_err(), "pages past the end mapped");
        assert_eq!(w.page_out(0, 8, &[true; 8]).unwrap().len(), 8);
    }

    #[test]
    fn the_window_drops_whole_fault_around_blocks() {
        assert_eq!(FAULT_AROUND.span(17, 2, 1000), (16, 32));
        assert_eq!(FAULT_AROUND.span(0, 16, 1000), (0, 16));
        assert_eq!(FAULT_AROUND.span(30, 5, 33), (16, 33));
    }
}
