//! The clock's R bits without userfaults (`MEMFOLD_CLOCK_RBITS=pagemap`,
//! `ClockRBits::Pagemap`; DE §4.2): guest RAM is registered for missing and write-protect
//! faults only, so a read of an armed page is the kernel's own minor fault, and the agent
//! reads R back at the next scan as "the PTE the clock zapped is present again". M still
//! comes from write-protect faults. Seen failing with the presence read removed from
//! `clock_scan` (the reads of pages 0 and 2 then report no R), with the registration left
//! at `RAM_MODE` (the agent then serves the first accesses as minor userfaults), and
//! without the missing fault's `unzap` (the hole's first touch then counts twice).

mod common;

use common::{agent_with_pool_rbits, clock_scan, next, page_of, region, write};
use memfold_agent::ClockRBits;
use memfold_codecs::PAGE_SIZE;
use memfold_wire::{Conn, ToDaemon};

const PAGES: usize = 8;

/// One clock scan of pages 0..PAGES arming `arm`; returns the R and M bits since the
/// last arming (bit g for page g).
fn clock(c: &Conn, batch: u64, arm: u64) -> (u64, u64) {
    clock_scan(c, batch, PAGES as u32, arm, 0)
}

#[test]
fn armed_pages_report_r_from_the_page_tables_and_m_from_write_faults() {
    let (_fd, ptr) = region(PAGES);
    // Before 6.7 the agent falls back to minor userfaults: nothing of this mode to test.
    let probe = memfold_sys::pagemap::Pagemap::open().and_then(|mut pm| {
        pm.scan(
            ptr as u64,
            PAGE_SIZE as u64,
            memfold_sys::pagemap::PAGE_IS_PRESENT,
            0,
        )
    });
    if let Err(e) = probe {
        memfold_sys::testing::skipped(
            "armed_pages_report_r_from_the_page_tables_and_m_from_write_faults",
            &format!("PAGEMAP_SCAN fails here (before 6.7?): {e}"),
        );
        return;
    }
    // Pages 0–6 hold data; page 7 is a hole never touched.
    for g in 0..PAGES - 1 {
        write(ptr, g, &vec![g as u8 + 1; PAGE_SIZE]);
    }
    let dir = tempfile::tempdir().unwrap();
    let (c, _pool, _store) =
        agent_with_pool_rbits(&dir.path().join("memfoldd.sock"), &[], ClockRBits::Pagemap);
    // Arm pages 0–5 and 7; 6 stays mapped, unarmed.
    clock(&c, 1, 0b1011_1111);
    // Read 0 and 2, write 1 and 4, read 6 (unarmed) and 7 (a hole: a missing fault the
    // agent serves with zeros, setting R itself).
    assert_eq!(page_of(ptr, 0), vec![1u8; PAGE_SIZE]);
    assert_eq!(page_of(ptr, 2), vec![3u8; PAGE_SIZE]);
    write(ptr, 1, &vec![0xa1; PAGE_SIZE]);
    write(ptr, 4, &vec![0xa4; PAGE_SIZE]);
    assert_eq!(page_of(ptr, 6), vec![7u8; PAGE_SIZE]);
    assert_eq!(page_of(ptr, 7), vec![0u8; PAGE_SIZE]);
    // Re-arm only 2 and 3.
    let (r, m) = clock(&c, 2, 0b1100);
    assert_eq!(r & 0xff, 0b1001_0111, "R: the accesses to armed pages");
    assert_eq!(m & 0xff, 0b0001_0010, "M: the writes");
    // Nothing touched since: no R, even where PTEs are present (0, 1, 4, 6, 7 stayed
    // mapped; their presence is not read as an access again).
    let (r, m) = clock(&c, 3, 0);
    assert_eq!((r & 0xff, m & 0xff), (0, 0));
    // Read 3 (re-armed at batch 2), 5 (armed at batch 1 and untouched since: still
    // armed, as its PTE would still be dropped in the userfault mode) and 0 (armed at
    // batch 1, read and reported at batch 2: mapped since, not armed again).
    assert_eq!(page_of(ptr, 3), vec![4u8; PAGE_SIZE]);
    assert_eq!(page_of(ptr, 5), vec![6u8; PAGE_SIZE]);
    assert_eq!(page_of(ptr, 0), vec![1u8; PAGE_SIZE]);
    let (r, _) = clock(&c, 4, 0);
    assert_eq!(r & 0xff, 0b0010_1000, "R: pages 3 and 5");
    // The data is the guest's throughout.
    for (g, b) in [
        (0, 1u8),
        (1, 0xa1),
        (2, 3),
        (3, 4),
        (4, 0xa4),
        (5, 6),
        (6, 7),
        (7, 0),
    ] {
        assert_eq!(page_of(ptr, g), vec![b; PAGE_SIZE], "page {g}");
    }
    // No access took a userfault but the two writes' write-protect faults (and the hole's
    // missing fault): the agent's clock service times (reported every second) count
    // exactly the former, where in the userfault mode every first access is one. The
    // first accesses since arming are still counted as minor faults (the kernel's): 0, 1,
    // 2, 4 at batch 2, 3 and 5 at batch 4 — not 7, whose first touch the agent served.
    let (minor, wp, served) = next(&c, |m| match m {
        ToDaemon::AgentStats(r) if r.minor_faults >= 6 => Some((
            r.minor_faults,
            r.wp_faults,
            r.track_ns.iter().map(|&(_, n)| n).sum::<u64>(),
        )),
        _ => None,
    });
    assert_eq!(minor, 6, "first accesses since arming");
    assert_eq!(wp, 2, "write-protect faults");
    assert_eq!(
        served, wp,
        "userfaults served for the clock: the writes' only"
    );
}
