//! A re-attach starts the page-out books afresh: pages an earlier memfoldd paged out
//! are in no re-attach list, so the new memfoldd knows nothing of them. Its page-out of
//! one is not refused as "paged out already" (a refusal it cannot explain), and their
//! return to RAM is not reported to it. Needs root (zswap and a swap file, put back).
//! Seen failing with the paged-out marks kept across the re-attach (a review of the
//! agent, 2026-12).
//!
//! One test only: the agent, run in this process, takes every QEMU-named memfd of it.

mod common;

use std::os::fd::AsFd;

use common::{accept_hello, clock_scan, region, start_agent_with, welcome, write};
use common::{page_of, text};
use memfold_agent::ClockRBits;
use memfold_codecs::PAGE_SIZE;
use memfold_sys::memfd;
use memfold_sys::testing::zswap_on_one_cpu;
use memfold_wire::{Conn, Gfn};

const PAGES: usize = 8;

/// [`common::page_out`], its pages as numbers.
fn page_out(c: &Conn, batch: u64, gfns: &[u32]) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let ids = |v: Vec<Gfn>| v.into_iter().map(|g| g.0).collect::<Vec<u32>>();
    let (p, r, f) = common::page_out(c, batch, gfns);
    (ids(p), ids(r), ids(f))
}

#[test]
fn pages_an_earlier_memfoldd_paged_out_are_not_refused_after_a_re_attach() {
    let dir = tempfile::tempdir().unwrap();
    let Some(_zswap) = zswap_on_one_cpu() else {
        return;
    };
    let (_fd, ptr) = region(PAGES);
    for g in 0..PAGES {
        write(ptr, g, &text(g));
    }
    let listener = start_agent_with(&dir.path().join("memfoldd.sock"), ClockRBits::Pagemap);
    let pool = memfd::create("fake-pool").unwrap();
    memfd::set_len(pool.as_fd(), PAGE_SIZE as u64).unwrap();
    let store = memfd::create("fake-store").unwrap();
    let c = accept_hello(&listener);
    welcome(&c, &pool, &store);
    clock_scan(&c, 1, PAGES as u32, 0xff, 0);
    let (paged, _, _) = common::page_out_retrying(&c, 2, &[0, 1, 2, 3], |_| true);
    assert_eq!(paged, [Gfn(0), Gfn(1), Gfn(2), Gfn(3)]);
    // The same memfoldd is refused a second page-out of a page it paged out.
    assert_eq!(page_out(&c, 3, &[0]).2, [0]);

    // memfoldd restarts: a new one welcomes the re-attach.
    drop(c);
    let c = accept_hello(&listener);
    welcome(&c, &pool, &store);
    clock_scan(&c, 4, PAGES as u32, 0xff, 0);
    let (paged, resident, refused) = page_out(&c, 5, &[0, 1]);
    assert!(
        refused.is_empty(),
        "refused as paged out by the earlier memfoldd"
    );
    assert_eq!(paged.len() + resident.len(), 2);
    for g in 0..PAGES {
        assert_eq!(page_of(ptr, g), text(g), "page {g}");
    }
}
