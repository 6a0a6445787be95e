//! The VMA budget is the whole process's, not a region's: a QEMU with two guest RAM
//! regions runs two agents, and a CoW break in either adds mappings to the one process
//! that `vm.max_map_count` (here `MEMFOLD_VMA_BUDGET`) bounds. A CoW break cannot be
//! refused (it would fail, and the guest be paused), so at the budget a break must add no
//! mapping: it un-shares its page's whole run of shared pages (`vmas.rs`).
//!
//! This test binary plays QEMU (two shared `memory-backend-memfd` memfds, as two NUMA
//! nodes' backends) and memfoldd (a listener speaking the wire), which asks each region's
//! agent, again and again, to share every private page onto the pool (both regions are
//! copies of the pool), until both are shared whole: in long runs, few mappings, far
//! more pages than the budget has mappings. Then the guest writes every other page of
//! both regions — the worst pattern, one mapping becoming three at each one-page break —
//! and the process's mappings must stay within the budget, the breaks at the budget
//! breaking whole runs, every page reading what the guest wrote. One test only: the agent
//! takes every such memfd of the process.

use std::time::{Duration, Instant};

mod common;

use common::{
    distinct_byte as pattern, distinct_page as page, filled_region, mappings, next,
    start_agent_budget, welcome,
};
use memfold_codecs::PAGE_SIZE;
use memfold_sys::memfd;
use memfold_wire::{BatchId, FrameId, Gfn, ToAgent, ToDaemon};

/// Pages of each region, and frames of the pool.
const PAGES: usize = 1000;
/// Mappings the budget allows beyond what the process has before the agent starts (and
/// the 100 of slack for the agent's own threads): room for about 600 pages on frames in
/// all, fewer than the 2000 that could share, more than either region alone holds back.
const ROOM: usize = 600;

#[test]
fn cow_breaks_in_two_regions_stay_within_one_process_budget() {
    // The pool: frame g holds page g of either region.
    let (pool, _) = filled_region("fake-pool", PAGES, page);
    let (_fd_a, ptr_a) = filled_region("memory-backend-memfd", PAGES, page);
    let (_fd_b, ptr_b) = filled_region("memory-backend-memfd", PAGES, page);
    let store = memfd::create("fake-store").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let budget = mappings() + 100 + ROOM;
    let listener = start_agent_budget(&dir.path().join("memfoldd.sock"), budget);

    let mut conns = Vec::new();
    for _ in 0..2 {
        let c = listener.accept().unwrap();
        c.set_recv_timeout(Duration::from_millis(200)).unwrap();
        let t = Instant::now();
        let hello = loop {
            if let Ok(Some((h, _))) = c.recv::<ToDaemon>() {
                break h;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "no hello");
        };
        let ToDaemon::AgentHello { ram_bytes, .. } = hello else {
            panic!("{hello:?}")
        };
        assert_eq!(ram_bytes, (PAGES * PAGE_SIZE) as u64);
        welcome(&c, &pool, &store);
        conns.push(c);
    }

    // Both regions, in turns, asked to share every page still private, until a round
    // shares nothing in either.
    let mut private = [(0..PAGES as u32).collect::<Vec<u32>>(), Vec::new()];
    private[1] = private[0].clone();
    let mut batch = 0;
    loop {
        let mut any = false;
        for (r, c) in conns.iter().enumerate() {
            if private[r].is_empty() {
                continue;
            }
            batch += 1;
            let pages = private[r].iter().map(|&g| (Gfn(g), FrameId(g))).collect();
            c.send(
                &ToAgent::Share {
                    batch: BatchId(batch),
                    pages,
                },
                &[],
            )
            .unwrap();
            let shared = next(c, |m| match m {
                ToDaemon::ShareDone {
                    batch: b, shared, ..
                } if *b == BatchId(batch) => Some(shared.clone()),
                _ => None,
            });
            any |= !shared.is_empty();
            private[r].retain(|g| !shared.contains(&Gfn(*g)));
        }
        if !any {
            break;
        }
    }
    let shared = [PAGES - private[0].len(), PAGES - private[1].len()];
    // Pages on frames cost no room: both regions shared whole, 2 000 pages on frames
    // under a budget of ~ROOM more mappings (it charged each page before issue 19).
    assert_eq!(shared, [PAGES, PAGES], "shared {shared:?}");
    assert!(
        2 * PAGES > budget - mappings(),
        "not vacuous: more pages than room"
    );

    // The agents report the breaks: their connections are read every 32 writes, or a
    // full socket would block them (and the faults they serve). On this thread: a thread
    // of the test's own would add mappings (its stack, its malloc arena) that the budget
    // leaves to QEMU's own room.
    for c in &conns {
        c.set_recv_timeout(Duration::from_millis(1)).unwrap();
    }
    let broken = std::cell::RefCell::new([Vec::new(), Vec::new()]);
    let drain = || {
        for (r, c) in conns.iter().enumerate() {
            while let Ok(Some((m, _))) = c.recv::<ToDaemon>() {
                if let ToDaemon::CowBroken { breaks } = m {
                    broken.borrow_mut()[r].extend(breaks.iter().map(|b| b.0 .0 as usize));
                }
            }
        }
    };

    // The worst pattern: a CoW break at every other page of both regions.
    let mut most = mappings();
    for g in (0..PAGES).step_by(2) {
        for ptr in [ptr_a, ptr_b] {
            // SAFETY: inside the region's mapping; the agent serves the fault.
            unsafe { std::ptr::write_volatile(ptr.add(g * PAGE_SIZE), 0) };
            most = most.max(mappings());
        }
        if g % 32 == 30 {
            drain();
        }
    }
    assert!(
        most <= budget,
        "{most} mappings after the CoW breaks, over the process's budget of {budget} (pages shared per region: {shared:?})"
    );
    // Every page written was broken, and at the budget whole runs were: pages the guest
    // never wrote (odd ones) came back private with them.
    let t = Instant::now();
    while broken.borrow().iter().map(Vec::len).sum::<usize>() < PAGES
        && t.elapsed() < Duration::from_secs(10)
    {
        drain();
    }
    for (r, b) in broken.borrow().iter().enumerate() {
        for g in (0..PAGES).step_by(2) {
            assert!(
                b.contains(&g),
                "region {r}: written page {g} reported no break"
            );
        }
        assert!(
            b.iter().any(|g| g % 2 == 1),
            "region {r}: no whole run was broken ({} breaks)",
            b.len()
        );
    }
    // Every page reads what was written.
    for (r, ptr) in [ptr_a, ptr_b].into_iter().enumerate() {
        for g in 0..PAGES {
            for i in [0, 1, PAGE_SIZE - 1] {
                let want = if g % 2 == 0 && i == 0 {
                    0
                } else {
                    pattern(g, i)
                };
                // SAFETY: inside the mapping.
                let got = unsafe { std::ptr::read_volatile(ptr.add(g * PAGE_SIZE + i)) };
                assert_eq!(got, want, "region {r} page {g} byte {i}");
            }
        }
    }
}
