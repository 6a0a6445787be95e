//! Which pages of a mapping have a PTE, read back without userfaultfd: the `PAGEMAP_SCAN`
//! ioctl on `/proc/self/pagemap` (Linux 6.7+, `Documentation/admin-guide/mm/pagemap.rst`)
//! and the file's 64-bit entries (bit 63: present). The agent's clock reads its R bits
//! this way in its `pagemap` mode (DE §4.2's referenced bit as "mapped since the clock
//! zapped it"), and `memfold bench fault-path` times it.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

/// Bytes in a page.
const PAGE: u64 = 4096;

/// `PAGEMAP_SCAN`: `_IOWR('f', 16, struct pm_scan_arg)`, `struct pm_scan_arg` 96 bytes.
const PAGEMAP_SCAN: libc::c_ulong = 0xC060_6610;
/// Category: written since write-protected (`UFFD_FEATURE_WP_ASYNC`).
pub const PAGE_IS_WRITTEN: u64 = 1 << 1;
/// Category: the PTE is present.
pub const PAGE_IS_PRESENT: u64 = 1 << 3;
/// Flag: write-protect the pages matched (a clock's "clear M").
pub const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
/// Flag: fail (`EPERM`) on a range not registered for asynchronous write-protect.
pub const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
/// `/proc/pid/pagemap` entry bit: the page is present.
const PM_PRESENT: u64 = 1 << 63;

/// `struct pm_scan_arg` (`include/uapi/linux/fs.h`).
#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// `struct page_region`: `[start, end)` (bytes, page-aligned addresses) whose pages share
/// the reported categories.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageRegion {
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
    /// `PAGE_IS_*` bits (of the return mask).
    pub categories: u64,
}

/// Pages the regions cover.
pub fn region_pages(regions: &[PageRegion]) -> u64 {
    regions.iter().map(|r| (r.end - r.start) / PAGE).sum()
}

/// Present pages among raw `/proc/pid/pagemap` entries (native-endian u64s).
pub fn present_entries(raw: &[u8]) -> u64 {
    raw.chunks_exact(8)
        .filter(|e| u64::from_ne_bytes((*e).try_into().expect("8 bytes")) & PM_PRESENT != 0)
        .count() as u64
}

/// This process's `/proc/self/pagemap`, open.
pub struct Pagemap {
    file: File,
    /// Output regions, reused across scans.
    vec: Vec<PageRegion>,
    raw: Vec<u8>,
}

impl Pagemap {
    /// Opens `/proc/self/pagemap`.
    ///
    /// Errors: the file cannot be opened (no procfs).
    pub fn open() -> io::Result<Pagemap> {
        Ok(Pagemap {
            file: File::open("/proc/self/pagemap")?,
            vec: vec![PageRegion::default(); 4096],
            raw: Vec::new(),
        })
    }

    /// `PAGEMAP_SCAN` over `[start, start+len)` (bytes, page-aligned): calls `each` with
    /// every region of pages having every category of `mask`, `flags` (`PM_SCAN_*`)
    /// applied to them; repeated from where the kernel stopped while its output vector
    /// fills. Returns the pages matched.
    ///
    /// Errors: the kernel has no `PAGEMAP_SCAN` (`ENOTTY`, before 6.7), refuses the
    /// flags on this range (`EPERM` for `PM_SCAN_CHECK_WPASYNC`), or makes no progress.
    pub fn scan_regions(
        &mut self,
        start: u64,
        len: u64,
        mask: u64,
        flags: u64,
        mut each: impl FnMut(&PageRegion),
    ) -> io::Result<u64> {
        let end = start + len;
        let mut at = start;
        let mut pages = 0;
        while at < end {
            let mut a = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                flags,
                start: at,
                end,
                vec: self.vec.as_mut_ptr() as u64,
                vec_len: self.vec.len() as u64,
                category_mask: mask,
                return_mask: mask,
                ..PmScanArg::default()
            };
            // SAFETY: PAGEMAP_SCAN reads the argument struct (which lives across the call)
            // and writes at most `vec_len` regions into `self.vec`, which has that many.
            // It changes no memory of this process; `PM_SCAN_WP_MATCHING` only
            // write-protects PTEs of ranges registered for asynchronous write-protect.
            let n = unsafe { libc::ioctl(self.file.as_raw_fd(), PAGEMAP_SCAN, &mut a) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            let found = &self.vec[..n as usize];
            pages += region_pages(found);
            found.iter().for_each(&mut each);
            if a.walk_end <= at {
                return Err(io::Error::other("PAGEMAP_SCAN made no progress"));
            }
            at = a.walk_end;
        }
        Ok(pages)
    }

    /// [`Pagemap::scan_regions`] counting only: the pages of `[start, start+len)` having
    /// every category of `mask`, `flags` applied to them.
    ///
    /// Errors: as [`Pagemap::scan_regions`].
    pub fn scan(&mut self, start: u64, len: u64, mask: u64, flags: u64) -> io::Result<u64> {
        self.scan_regions(start, len, mask, flags, |_| {})
    }

    /// Present pages of `[start, start+len)` read from the pagemap file (one `pread` of
    /// 8 bytes a page).
    ///
    /// Errors: the read fails.
    pub fn read_present(&mut self, start: u64, len: u64) -> io::Result<u64> {
        self.raw.resize((len / PAGE * 8) as usize, 0);
        self.file.read_exact_at(&mut self.raw, start / PAGE * 8)?;
        Ok(present_entries(&self.raw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_count_their_pages() {
        let r = |start: u64, pages: u64| PageRegion {
            start,
            end: start + pages * PAGE,
            categories: PAGE_IS_PRESENT,
        };
        assert_eq!(region_pages(&[]), 0);
        assert_eq!(region_pages(&[r(0x10000, 1), r(0x40000, 16)]), 17);
        assert_eq!(std::mem::size_of::<PmScanArg>(), 96);
        assert_eq!(std::mem::size_of::<PageRegion>(), 24);
    }

    #[test]
    fn pagemap_entries_are_present_by_bit_63() {
        let entries: [u64; 4] = [
            PM_PRESENT | 0x1234,    // present, a PFN
            1 << 62,                // swapped
            0,                      // none
            PM_PRESENT | (1 << 61), // present, file page
        ];
        let raw: Vec<u8> = entries.iter().flat_map(|e| e.to_ne_bytes()).collect();
        assert_eq!(present_entries(&raw), 2);
        assert_eq!(present_entries(&raw[..8]), 1);
    }

    /// The regions name exactly the pages touched since the mapping was made (on a kernel
    /// without `PAGEMAP_SCAN` there is nothing to check).
    #[test]
    fn present_regions_are_the_pages_touched() {
        let pages = 16usize;
        // SAFETY: a fresh private anonymous mapping, touched only below and unmapped at the end.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * PAGE as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let base = p as u64;
        // SAFETY: p is page-aligned and the mapping is private to this test.
        unsafe { libc::madvise(p, pages * PAGE as usize, libc::MADV_NOHUGEPAGE) };
        for k in [1usize, 2, 7, 15] {
            // SAFETY: within the mapping above.
            unsafe { (p as *mut u8).add(k * PAGE as usize).write_volatile(1) };
        }
        let mut pm = Pagemap::open().unwrap();
        let mut found = Vec::new();
        match pm.scan_regions(base, pages as u64 * PAGE, PAGE_IS_PRESENT, 0, |r| {
            for a in (r.start..r.end).step_by(PAGE as usize) {
                found.push(((a - base) / PAGE) as usize);
            }
        }) {
            Ok(n) => {
                assert_eq!(found, vec![1, 2, 7, 15]);
                assert_eq!(n, 4);
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOTTY) => crate::testing::skipped(
                "present_regions_are_the_pages_touched",
                "no PAGEMAP_SCAN in this kernel (before 6.7): only read_present checked",
            ),
            Err(e) => panic!("PAGEMAP_SCAN: {e}"),
        }
        assert_eq!(pm.read_present(base, pages as u64 * PAGE).unwrap(), 4);
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(p, pages * PAGE as usize) };
    }
}
