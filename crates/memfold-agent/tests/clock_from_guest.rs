//! The clock's arming for writes only (issue 17, "the clock from the guest's LRU";
//! `ToAgent::ClockScan::wp_only`): pages memfoldd takes R for from an enlightened guest's
//! own LRU bits are write-protected but not zapped, so a read of one takes no fault and
//! reports no R, while a write still faults and reports M. Pages armed as before report
//! R for a read. Seen failing with the zap applied to every armed page (page 0's read
//! then reports R).

mod common;

use common::{agent_with_pool, clock_scan, page_of, region, write};
use memfold_codecs::PAGE_SIZE;
use memfold_wire::Conn;

const PAGES: usize = 8;

/// One clock scan of pages 0..PAGES arming `arm`, `wp_only` of them for writes only;
/// returns the R and M bits since the last arming (bit g for page g).
fn clock(c: &Conn, batch: u64, arm: u64, wp_only: u64) -> (u64, u64) {
    clock_scan(c, batch, PAGES as u32, arm, wp_only)
}

#[test]
fn pages_armed_for_writes_only_report_writes_not_reads() {
    let (_fd, ptr) = region(PAGES);
    for g in 0..PAGES {
        write(ptr, g, &vec![g as u8 + 1; PAGE_SIZE]);
    }
    let dir = tempfile::tempdir().unwrap();
    let (c, _pool, _store) = agent_with_pool(&dir.path().join("memfoldd.sock"), &[]);
    // Arm pages 0–3: 0 and 1 for writes only, 2 and 3 fully.
    clock(&c, 1, 0b1111, 0b0011);
    // Read 0 and 2, write 1 and 3.
    assert_eq!(page_of(ptr, 0), vec![1u8; PAGE_SIZE]);
    assert_eq!(page_of(ptr, 2), vec![3u8; PAGE_SIZE]);
    write(ptr, 1, &vec![0xa1; PAGE_SIZE]);
    write(ptr, 3, &vec![0xa3; PAGE_SIZE]);
    let (r, m) = clock(&c, 2, 0, 0);
    assert_eq!(r & 0b1111, 0b1110, "R: no fault for page 0's read");
    assert_eq!(m & 0b1111, 0b1010, "M: both writes, armed either way");
    assert_eq!(page_of(ptr, 1), vec![0xa1; PAGE_SIZE]);
    assert_eq!(page_of(ptr, 3), vec![0xa3; PAGE_SIZE]);
}
