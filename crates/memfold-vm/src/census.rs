//! Reading a QEMU's anonymous guest RAM page by page from outside, for a census of its
//! content (Satori §6.1's sharing potential) on guests memfold does not manage (the KSM
//! side of a comparison). Pages are read through `/proc/PID/mem`, which goes through
//! the process's page tables: only pages present there are read (`/proc/PID/pagemap`
//! says which), so nothing is faulted in or swapped in by the census.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;

const PAGE: u64 = 4096;
/// Pages read at a time.
const RUN: u64 = 64;
/// pagemap: page present in RAM (bit 63), swapped (bit 62), the frame number (bits 0–54,
/// zero unless the reader has `CAP_SYS_ADMIN`).
const PRESENT: u64 = 1 << 63;
const SWAPPED: u64 = 1 << 62;
const PFN: u64 = (1 << 55) - 1;

/// One guest page as the census sees it.
#[derive(Debug, PartialEq, Eq)]
pub enum RamPage<'a> {
    /// Present: its bytes (4 KiB) and the host frame that holds them (0 if the reader may
    /// not see frame numbers): pages merged by KSM share one frame.
    Data {
        /// The page's bytes.
        bytes: &'a [u8],
        /// Host page frame number.
        pfn: u64,
    },
    /// Never touched (reads as zeros, holds no memory).
    Untouched,
    /// Swapped out (or otherwise not readable without faulting it in).
    Unknown,
}

/// Calls `f` for every page of process `pid`'s anonymous read-write mappings of at least
/// `min_bytes` (a QEMU's guest RAM, as [`crate::hostmem::guest_ram_usage`] finds it).
/// Returns the pages visited.
///
/// Errors: the process's maps, pagemap or memory cannot be read (it exited, or no
/// permission: reading another process's pagemap and memory needs `CAP_SYS_ADMIN` /
/// ptrace rights).
pub fn for_each_ram_page(
    pid: u32,
    min_bytes: u64,
    mut f: impl FnMut(RamPage<'_>),
) -> std::io::Result<u64> {
    let maps = BufReader::new(File::open(format!("/proc/{pid}/maps"))?);
    let pagemap = File::open(format!("/proc/{pid}/pagemap"))?;
    let mem = File::open(format!("/proc/{pid}/mem"))?;
    let mut visited = 0;
    let mut entries = vec![0u8; RUN as usize * 8];
    let mut buf = vec![0u8; (RUN * PAGE) as usize];
    for line in maps.lines() {
        let line = line?;
        let mut parts = line.split_whitespace();
        let range = parts.next().unwrap_or("");
        let perms = parts.next().unwrap_or("");
        let path = parts.nth(3);
        let Some((s, e)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) else {
            continue;
        };
        if path.is_some() || !perms.starts_with("rw") || end - start < min_bytes {
            continue;
        }
        let mut at = start;
        while at < end {
            let n = ((end - at) / PAGE).min(RUN);
            let e = &mut entries[..n as usize * 8];
            pagemap.read_exact_at(e, at / PAGE * 8)?;
            let flags: Vec<u64> = e
                .chunks_exact(8)
                .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")))
                .collect();
            // One read for the run when every page is present; page by page otherwise.
            let all = flags.iter().all(|&x| x & PRESENT != 0);
            if all {
                mem.read_exact_at(&mut buf[..(n * PAGE) as usize], at)?;
            }
            for (i, &x) in flags.iter().enumerate() {
                let page = &mut buf[i * PAGE as usize..(i + 1) * PAGE as usize];
                let seen = if x & PRESENT != 0 {
                    if !all {
                        mem.read_exact_at(page, at + i as u64 * PAGE)?;
                    }
                    RamPage::Data {
                        bytes: page,
                        pfn: x & PFN,
                    }
                } else if x & SWAPPED != 0 {
                    RamPage::Unknown
                } else {
                    RamPage::Untouched
                };
                f(seen);
            }
            visited += n;
            at += n * PAGE;
        }
    }
    Ok(visited)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This process's own 64-page anonymous mapping: written pages read back with their
    /// bytes, the others as untouched; the census reads nothing into memory.
    #[test]
    fn present_pages_are_read_and_untouched_ones_are_not_faulted_in() {
        let len = 64 * PAGE as usize;
        // A guard page of no access on each side: the kernel would merge a bare mapping
        // with a neighbour of the same flags (another test thread's), and it would no
        // longer be its own line in maps (seen once in CI).
        // SAFETY: a new private anonymous mapping of this test's own.
        let outer = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len + 2 * PAGE as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        } as *mut u8;
        assert_ne!(outer as *mut libc::c_void, libc::MAP_FAILED);
        // SAFETY: the pages between the guards, inside the mapping made above.
        let p = unsafe { outer.add(PAGE as usize) };
        // SAFETY: as above; the range is ours.
        let r = unsafe {
            libc::mprotect(
                p as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
        assert_eq!(r, 0);
        for g in [3usize, 10, 11] {
            // SAFETY: within the mapping.
            unsafe { std::ptr::write_bytes(p.add(g * PAGE as usize), g as u8 + 1, PAGE as usize) };
        }
        let (start, end) = (p as u64, p as u64 + len as u64);
        let mut seen = Vec::new();
        // Only mappings of exactly this size are taken; find ours among them by address.
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let mine = maps
            .lines()
            .any(|l| l.starts_with(&format!("{start:x}-{end:x}")));
        assert!(mine, "the mapping is its own line in maps");
        for_each_ram_page(std::process::id(), len as u64, |page| {
            seen.push(match page {
                RamPage::Data { bytes, pfn } => {
                    assert_ne!(pfn, 0, "root sees frame numbers");
                    Some(bytes[0])
                }
                RamPage::Untouched => None,
                RamPage::Unknown => Some(0xff),
            })
        })
        .unwrap();
        // Other anonymous mappings of the test process may be visited too: find ours.
        let ours: Vec<usize> = (0..seen.len().saturating_sub(63))
            .filter(|&k| seen[k + 3] == Some(4) && seen[k + 10] == Some(11))
            .collect();
        assert_eq!(ours.len(), 1, "{seen:?}");
        let k = ours[0];
        assert_eq!(seen[k + 11], Some(12));
        let present = seen[k..k + 64].iter().filter(|s| s.is_some()).count();
        assert_eq!(
            present,
            3,
            "untouched pages were faulted in: {:?}",
            &seen[k..k + 64]
        );
        // SAFETY: the mapping made above with its guards, unmapped once.
        unsafe { libc::munmap(outer as *mut libc::c_void, len + 2 * PAGE as usize) };
    }
}
