//! Pages sent to the kernel's swap (issue 15's zswap backing, `ToAgent::PageOut`): under
//! the `pagemap` clock the agent pages armed, untouched private pages out through its own
//! read-only window; the guest's next read is the kernel's swap-in (no userfault), a
//! write still faults for M, the pages read back as written, and the next clock scan
//! reports them in RAM again (`ToDaemon::PagedIn`). Pages in use, not private, or past
//! RAM stay. Needs root (a swap file and zswap for the test's length; both put back).
//! Seen failing with the window's read dropped from `PageOutWindow::page_out` (nothing
//! leaves RAM: the armed pages are mapped nowhere), with `MINOR` left in the pagemap
//! registration (the test then waits in vain), and with the
//! paged-in check removed from `clock_scan` (no `PagedIn`), and with the agent taking the
//! remove event of its own arming zap for a discard of the paged-out pages (they were
//! reported back though still in swap: in a live run every clock pass did so, and
//! memfoldd's scans then read ~120 000 pages back in from zswap in 100 s).

mod common;

use common::{
    agent_with_pool_rbits, clock_scan, next, page_of, page_out, page_out_retrying, region, write,
};
use memfold_agent::ClockRBits;
use memfold_codecs::PAGE_SIZE;
use memfold_sys::pageout::PageOutWindow;
use memfold_sys::testing::zswap_on_one_cpu;
use memfold_wire::{Gfn, ToDaemon};
use std::os::fd::AsFd;

const PAGES: usize = 16;

/// Text-like bytes for page `g` (compress well, differ by page).
fn text(g: usize) -> Vec<u8> {
    (0..PAGE_SIZE)
        .map(|i| b"paged out to zswap "[(i * 7 + g * 3) % 19] ^ (g as u8 & 7))
        .collect()
}

#[test]
fn armed_pages_go_to_zswap_come_back_by_the_kernel_and_are_reported_back() {
    let dir = tempfile::tempdir().unwrap();
    let Some(_zswap) = zswap_on_one_cpu() else {
        return;
    };
    let (fd, ptr) = region(PAGES);
    for g in 0..PAGES {
        write(ptr, g, &text(g));
    }
    let (c, _pool, _store) =
        agent_with_pool_rbits(&dir.path().join("memfoldd.sock"), &[], ClockRBits::Pagemap);
    // A window of the test's own to see what is in RAM.
    let seen = PageOutWindow::new(fd.as_fd(), (PAGES * PAGE_SIZE) as u64).unwrap();
    // Arm pages 0–11; read 10 and 11 (mapped again: in use).
    clock_scan(&c, 1, PAGES as u32, 0x0fff, 0);
    assert_eq!(page_of(ptr, 10), text(10));
    assert_eq!(page_of(ptr, 11), text(11));
    // 0–9 armed and untouched go; 10, 11 (used) and 12–15 (never armed: QEMU maps them)
    // stay; page 99 is past RAM.
    let (paged, resident, refused) = page_out_retrying(
        &c,
        2,
        &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 99],
        |g| g < 10,
    );
    let ids = |v: &[Gfn]| v.iter().map(|g| g.0).collect::<Vec<u32>>();
    assert_eq!(ids(&paged), (0..10).collect::<Vec<u32>>(), "paged out");
    assert_eq!(ids(&resident), vec![10, 11, 12], "in use: left in RAM");
    assert_eq!(ids(&refused), vec![99]);
    let r = seen.resident(0, PAGES as u64).unwrap();
    assert_eq!(r.iter().take(10).filter(|&&x| x).count(), 0, "{r:?}");
    // A page already paged out is refused, not paged twice.
    let (p2, _, r2) = page_out(&c, 3, &[0]);
    assert_eq!((p2.len(), ids(&r2)), (0, vec![0]));
    // The next clock pass arms 5–9 again: its zap (`MADV_DONTNEED`) comes back to the
    // agent as a remove event, as QEMU's discards do, but the pages are still swapped
    // out, not punched. Nothing is reported for them, and the scan below finds them out.
    clock_scan(&c, 5, PAGES as u32, 0x3e0, 0);
    let r = seen.resident(0, PAGES as u64).unwrap();
    assert_eq!(r.iter().take(10).filter(|&&x| x).count(), 0, "{r:?}");
    // The guest reads 0–3 (the kernel's swap-ins) and writes 4 (a write-protect fault:
    // M); every page holds what was written.
    for g in 0..4 {
        assert_eq!(page_of(ptr, g), text(g), "page {g}");
    }
    write(ptr, 4, b"written after the page-out");
    let mut four = text(4);
    four[..26].copy_from_slice(b"written after the page-out");
    assert_eq!(page_of(ptr, 4), four);
    // The next scan: R for 0–4, M for 4; 0–4 reported in RAM again, and of 5–9 exactly
    // those in RAM too (swap readahead brings neighbours of a swap-in into the swap cache:
    // RAM again, though the guest did not touch them).
    let (r, m) = clock_scan(&c, 4, PAGES as u32, 0, 0);
    assert_eq!(r & 0x1f, 0x1f, "R: the pages read or written back");
    assert_eq!(m & 0x3ff, 0x10, "M: the write");
    let back = next(&c, |m| match m {
        ToDaemon::PagedIn { gfns } => Some(ids(gfns)),
        _ => None,
    });
    let now = seen.resident(0, PAGES as u64).unwrap();
    let want: Vec<u32> = (0..10).filter(|&g| now[g as usize]).collect();
    assert!(back.starts_with(&[0, 1, 2, 3, 4]), "{back:?}");
    assert_eq!(back, want, "reported back: the paged-out pages in RAM now");
    // None of those accesses waited on the agent but the write (its write-protect fault).
    let (wp, served) = next(&c, |m| match m {
        ToDaemon::AgentStats(r) if r.wp_faults >= 1 => {
            Some((r.wp_faults, r.track_ns.iter().map(|&(_, n)| n).sum::<u64>()))
        }
        _ => None,
    });
    assert_eq!((wp, served), (1, 1), "userfaults: the write's only");
    // The rest read back right too.
    for g in 5..PAGES {
        assert_eq!(page_of(ptr, g), text(g), "page {g}");
    }
    // QEMU discards a paged-out page (a balloon, free page reporting: punch, then
    // `MADV_DONTNEED`): that one is reported back — the kernel holds it no more — and its
    // paged-out neighbours, in the same remove event's range, are not.
    clock_scan(&c, 6, PAGES as u32, 0xf000, 0);
    let (paged, _, _) = page_out_retrying(&c, 7, &[12, 13, 14, 15], |_| true);
    assert_eq!(ids(&paged), vec![12, 13, 14, 15]);
    assert!(memfold_sys::memfd::punch_hole(
        fd.as_fd(),
        13 * PAGE_SIZE as u64,
        PAGE_SIZE as u64
    ));
    // SAFETY: drops the PTEs of pages 12–15 of the test's own mapping (the memfd keeps
    // what is left of them), as QEMU's ram_block_discard_range does after its punch.
    let rc = unsafe {
        libc::madvise(
            ptr.add(12 * PAGE_SIZE).cast(),
            4 * PAGE_SIZE,
            libc::MADV_DONTNEED,
        )
    };
    assert_eq!(rc, 0);
    let back = next(&c, |m| match m {
        ToDaemon::PagedIn { gfns } => Some(ids(gfns)),
        _ => None,
    });
    assert_eq!(back, vec![13], "only the punched page");
    let r = seen.resident(12, 4).unwrap();
    assert_eq!(r, vec![false; 4], "12, 14, 15 still out; 13 a hole");
    assert_eq!(
        page_of(ptr, 13),
        vec![0u8; PAGE_SIZE],
        "a discarded page reads zeros"
    );
    assert_eq!(page_of(ptr, 14), text(14));
}
