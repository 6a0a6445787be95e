//! A discarded range, live (issue 14, KSM parity: the selftests' unmerge of a range
//! dropped with `MADV_DONTNEED`): this test process plays QEMU — guest RAM a memfd
//! mapping, the real agent in a thread, memfoldd in another — and discards half of guest
//! RAM as QEMU's `ram_block_discard_range` does for a balloon or free page reporting:
//! `fallocate(PUNCH_HOLE)` on the memfd, then `MADV_DONTNEED` on the mapping. Every page
//! memfold held in the range (on a pool frame, a reclaimed zero page, a stored blob) must
//! be let go — memfoldd's `discards` counts exactly those — no page of the range may stay
//! on the pool, the range must read as zeros, and the other half must read as written.

mod common;

use std::os::fd::AsRawFd;
use std::time::Duration;

use common::{
    every_mechanism, fast_engine, fill_every_mechanism, managed, start_agent, start_memfoldd,
    vm_named, wait_for, GuestRam, PAGE,
};

const PAGES: usize = 1280;

const NAME: &str = "ballooned";

#[test]
fn a_discarded_range_is_let_go_exactly_and_reads_as_zeros() {
    let work = tempfile::tempdir().unwrap();
    let socket = start_memfoldd(work.path(), fast_engine());
    let ram = GuestRam::new("ballooned-guest-ram", PAGES);
    let want = fill_every_mechanism(&ram, 17);
    start_agent(&socket, "ballooned", &ram);
    wait_for(&socket, Duration::from_secs(30), "every mechanism", |s| {
        every_mechanism(vm_named(s, NAME))
    });
    // Settled: nothing left for memfoldd to do, so that what it holds in the range does
    // not change while it is counted.
    let mut last = u64::MAX;
    let before = loop {
        std::thread::sleep(Duration::from_millis(1500));
        let s = memfold_live::query_stats(&socket).unwrap();
        let now = managed(vm_named(&s, NAME));
        if now == last {
            break s;
        }
        last = now;
    };
    let range = 0..PAGES / 2;
    // What memfold holds there: pages on the pool, and holes (reclaimed or stored; every
    // page was written, so no hole is a never-touched page).
    let held = range
        .clone()
        .filter(|&g| ram.on_pool(g) || !ram.has_data(g))
        .count() as u64;
    let on_pool = range.clone().filter(|&g| ram.on_pool(g)).count() as u64;
    assert!(
        on_pool > 0 && held > on_pool,
        "{on_pool} on the pool, {held} held"
    );

    // QEMU's ram_block_discard_range: punch, then drop the mapping (which the agent is
    // told of, and this thread waits for).
    let (off, len) = (range.start * PAGE, range.len() * PAGE);
    // SAFETY: punches a range of the memfd this test owns.
    let rc = unsafe {
        libc::fallocate(
            ram.fd.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off as i64,
            len as i64,
        )
    };
    assert_eq!(rc, 0, "punch: {}", std::io::Error::last_os_error());
    // SAFETY: drops the PTEs of guest RAM this test maps; no Rust reference points into it.
    let rc = unsafe { libc::madvise(ram.page_ptr(range.start).cast(), len, libc::MADV_DONTNEED) };
    assert_eq!(rc, 0, "madvise: {}", std::io::Error::last_os_error());

    let s = wait_for(
        &socket,
        Duration::from_secs(10),
        "the discards booked",
        |s| vm_named(s, NAME).discards >= held,
    );
    let v = vm_named(&s, NAME);
    assert_eq!(
        v.discards, held,
        "exactly the pages memfold held in the range"
    );
    assert_eq!(
        v.cow_copies_avoided, on_pool,
        "no-copy-on-write: every page of the range on the pool dropped, not copied"
    );
    assert!(
        v.shared_pages <= vm_named(&before, NAME).shared_pages - on_pool,
        "the range's shares released: {} before, {} after, {on_pool} on the pool",
        vm_named(&before, NAME).shared_pages,
        v.shared_pages
    );
    assert_eq!(
        (v.cow_breaks, v.unstashes),
        (
            vm_named(&before, NAME).cow_breaks,
            vm_named(&before, NAME).unstashes
        ),
        "a discard is neither a CoW break nor a decode"
    );
    let mut got = vec![0u8; PAGE];
    for g in range.clone() {
        assert!(!ram.on_pool(g), "gfn {g} still maps a pool frame");
        ram.read(g, &mut got);
        assert!(
            got.iter().all(|&b| b == 0),
            "discarded gfn {g} reads other bytes than zeros"
        );
    }
    for (g, w) in want.iter().enumerate().skip(range.end) {
        ram.read(g, &mut got);
        assert_eq!(&got, w, "gfn {g}, outside the range, reads other bytes");
    }
    // memfoldd's books stay whole: what it holds is what it booked.
    let s = memfold_live::query_stats(&socket).unwrap();
    assert_eq!(s.held.unbooked(), 0, "{:#?}", s.held);
}
