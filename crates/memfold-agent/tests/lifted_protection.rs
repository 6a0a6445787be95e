//! The clock's M bit survives a lifted write-protection: a page the clock armed and the
//! guest then read is mapped write-protected so that its next write sets M; a share of it
//! that finds its bytes changed (or refused) lifts the protection, after which writes take
//! no fault. The agent then counts the page modified, as it cannot see them — but not a
//! page that left RAM (a zero page reclaimed), read back later unwritten. Seen failing
//! with M left as it was (a review of the agent, 2026-12: the page's writes went unseen
//! and the Difference Engine took it for clean), and with M set on every page whose
//! protection was lifted (page 6 then counted written).

mod common;

use common::{agent_with_pool, clock_scan, next, page_of, share, write};
use memfold_codecs::PAGE_SIZE;
use memfold_wire::{BatchId, FrameId, Gfn, ToAgent, ToDaemon};

const PAGES: usize = 8;

#[test]
fn a_share_that_finds_a_page_changed_leaves_its_later_writes_counted() {
    let (_fd, ptr) = common::region(PAGES);
    for g in 0..PAGES {
        write(ptr, g, &vec![g as u8 + 1; PAGE_SIZE]);
    }
    // Page 6 is zero (reclaimed below).
    write(ptr, 6, &vec![0u8; PAGE_SIZE]);
    let dir = tempfile::tempdir().unwrap();
    let (c, _pool, _store) =
        agent_with_pool(&dir.path().join("memfoldd.sock"), &[vec![0xee; PAGE_SIZE]]);
    // Arm page 3 (and take the first pass's bits), then read it: R, mapped write-protected.
    clock_scan(&c, 1, PAGES as u32, 0b1000, 0);
    assert_eq!(page_of(ptr, 3), vec![4u8; PAGE_SIZE]);
    // A share onto a frame of other bytes: not shared, its protection lifted.
    let (shared, _refused, _changed) = share(&c, BatchId(2), vec![(Gfn(3), FrameId(0))]);
    assert!(shared.is_empty(), "page 3 differs from frame 0");
    write(ptr, 3, &vec![0xa3; PAGE_SIZE]);
    let (r, m) = clock_scan(&c, 3, PAGES as u32, 0, 0);
    assert_eq!(r >> 3 & 1, 1, "R: the read");
    assert_eq!(
        m >> 3 & 1,
        1,
        "M: the write after the share, though it took no fault"
    );
    assert_eq!(page_of(ptr, 3), vec![0xa3; PAGE_SIZE]);

    // A page that leaves RAM (a zero page reclaimed) is not counted modified by the
    // lifted protection: read back, it was not written.
    let (c, gfns) = (&c, vec![Gfn(6)]);
    c.send(
        &ToAgent::ReclaimZero {
            batch: BatchId(4),
            gfns,
        },
        &[],
    )
    .unwrap();
    let done = next(c, |m| match m {
        ToDaemon::ReclaimDone {
            batch: BatchId(4),
            reclaimed,
            ..
        } => Some(reclaimed.clone()),
        _ => None,
    });
    assert_eq!(done, [Gfn(6)]);
    assert_eq!(page_of(ptr, 6), vec![0u8; PAGE_SIZE]);
    let (_, m) = clock_scan(c, 5, PAGES as u32, 0, 0);
    assert_eq!(m >> 6 & 1, 0, "M: page 6 was read back, not written");
}
