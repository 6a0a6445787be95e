//! A discard by QEMU (a balloon inflating, free page reporting) over pages on pool
//! frames maps guest RAM back over each, and one page inside a run of shared pages
//! turns one mapping into three, as a CoW break does. The break keeps to the VMA budget
//! (`vmas.rs`: past it QEMU's own `mmap`s — thread stacks, large allocations — would
//! fail, and QEMU with them); the discard did not. Here a region shared whole, in long
//! runs, is discarded every other page under a budget with room for ~600 mappings: the
//! process's mappings must stay within the budget, every page kept reading its bytes and
//! every discarded one zeros or, where no room was left, its own bytes on its frame.
//!
//! Seen failing without the budget check: the mappings grew past the budget.
//!
//! One test only: the agent, run in this process, takes every QEMU-named memfd of it.

use std::time::Duration;

mod common;

use common::{
    accept_hello, distinct_page as page, filled_region, mappings, next, page_of,
    start_agent_budget, welcome,
};
use memfold_codecs::PAGE_SIZE;
use memfold_sys::memfd;
use memfold_wire::{BatchId, FrameId, Gfn, ToAgent, ToDaemon};
use rustix::fs::FallocateFlags;

/// Pages of the region, and frames of the pool.
const PAGES: usize = 2000;
/// Mappings the budget allows beyond what the process has before the agent starts (and
/// the 100 of slack for the agent's own threads).
const ROOM: usize = 600;

#[test]
fn a_discard_over_shared_pages_stays_within_the_vma_budget() {
    let (pool, _) = filled_region("fake-pool", PAGES, page);
    let (ram, ptr) = filled_region("memory-backend-memfd", PAGES, page);
    let store = memfd::create("fake-store").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let budget = mappings() + 100 + ROOM;
    let listener = start_agent_budget(&dir.path().join("memfoldd.sock"), budget);
    let c = accept_hello(&listener);
    welcome(&c, &pool, &store);

    // Every page onto its frame (g onto g: one long run), asked again while a request
    // shares any (each shares what the room allows).
    let mut private: Vec<u32> = (0..PAGES as u32).collect();
    for batch in 1.. {
        let pages = private.iter().map(|&g| (Gfn(g), FrameId(g))).collect();
        c.send(
            &ToAgent::Share {
                batch: BatchId(batch),
                pages,
            },
            &[],
        )
        .unwrap();
        let shared = next(&c, |m| match m {
            ToDaemon::ShareDone {
                batch: b, shared, ..
            } if *b == BatchId(batch) => Some(shared.clone()),
            _ => None,
        });
        private.retain(|g| !shared.contains(&Gfn(*g)));
        if shared.is_empty() || private.is_empty() {
            break;
        }
    }
    assert!(private.is_empty(), "{} pages not shared", private.len());
    assert!(
        PAGES > budget - mappings(),
        "not vacuous: more pages than room"
    );

    // QEMU's discard of every other page: the punch, then the mapping dropped (the
    // event the agent handles; the caller waits until it is read).
    c.set_recv_timeout(Duration::from_millis(1)).unwrap();
    let mut most = mappings();
    let discard = |g: usize| {
        let at = (g * PAGE_SIZE) as u64;
        let flags = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
        rustix::fs::fallocate(&ram, flags, at, PAGE_SIZE as u64).unwrap();
        // SAFETY: one page of the region's mapping; its bytes are discarded on purpose.
        let r = unsafe {
            libc::madvise(
                ptr.add(g * PAGE_SIZE).cast(),
                PAGE_SIZE,
                libc::MADV_DONTNEED,
            )
        };
        assert_eq!(r, 0);
        // The agent's reports, read so that its socket never fills.
        while let Ok(Some(_)) = c.recv::<ToDaemon>() {}
    };
    for g in (0..PAGES).step_by(2) {
        discard(g);
        most = most.max(mappings());
    }
    assert!(
        most <= budget,
        "{most} mappings after the discards, over the budget of {budget}"
    );
    let mut zeros = 0;
    for g in 0..PAGES {
        let got = page_of(ptr, g);
        if g % 2 == 1 {
            assert!(got == page(g), "page {g}, not discarded, differs");
        } else if got == vec![0u8; PAGE_SIZE] {
            zeros += 1;
        } else {
            assert!(
                got == page(g),
                "page {g}, discarded, reads neither zeros nor its bytes"
            );
        }
    }
    assert!(zeros > 0, "no discarded page was let go");
    assert!(zeros < PAGES / 2, "not vacuous: the budget ran out");

    // At the budget, a page alone on its frame (both neighbours mapped back) is still
    // let go: mapping guest RAM back over it takes mappings away.
    let hole = vec![0u8; PAGE_SIZE];
    let alone = (1..PAGES - 1)
        .step_by(2)
        .find(|&g| page_of(ptr, g - 1) == hole && page_of(ptr, g + 1) == hole)
        .expect("a page between two let go");
    discard(alone);
    assert!(
        page_of(ptr, alone) == hole,
        "page {alone}, alone, kept on its frame"
    );
}
