//! Faults of the backings memfoldd keeps pages in (issue 14: "no fault loses a byte").
//! A swap file whose write-back fails (EIO, a full disk) may not hold the blobs written
//! since its last good sync: memfoldd must not hand out the swap-outs that rely on them.
//! Run on the engine memfoldd runs, with the in-memory agent (`memfold_core::sim::Rig`);
//! the in-memory swap file loses what a failed sync did not make durable.

use memfold_core::blobs::BlobHome;
use memfold_core::engine::Command;
use memfold_core::ids::{Gfn, VmId};
use memfold_core::sim::Rig;
use memfold_core::{EngineConfig, Policy, PAGE_SIZE};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const PAGES: u32 = 64;

fn vm_books(r: &Rig, vm: VmId) -> memfold_core::engine::VmBooks {
    let b = r.engine.books();
    b.vms
        .into_iter()
        .find(|v| v.id == vm)
        .expect("the guest")
        .books
}

/// The engine as these tests run it: `policy`, a clock pass every 100 ms, scans every
/// 10 ms, no rate limit, a host budget of `budget` bytes if any.
fn cfg(policy: Policy, budget: Option<u64>) -> EngineConfig {
    EngineConfig {
        policy,
        rate: 0,
        clock_interval_us: Some(100_000),
        min_scan_interval_us: 10_000,
        max_scan_interval_us: 10_000,
        host_budget: budget,
        ..EngineConfig::default()
    }
}

/// Writes a line of text of its own into every page of `r`'s guest (each compresses, no
/// two alike), `what` naming the test in it; returns the pages as written.
fn text_pages(r: &mut Rig, what: &str) -> Vec<Vec<u8>> {
    (0..PAGES)
        .map(|g| {
            let line = format!("page {g} of the {what} test, a line of its own; ");
            let p: Vec<u8> = line.bytes().cycle().take(PAGE_SIZE).collect();
            r.agent.write(Gfn(g), 0, &p).unwrap();
            p
        })
        .collect()
}

/// Every page of `r`'s guest reads as `model` holds it (read by the guest: what is
/// stored is decoded back).
fn reads_back(r: &mut Rig, model: &[Vec<u8>]) {
    for g in 0..PAGES {
        assert_eq!(
            r.agent.read(Gfn(g)).unwrap()[..],
            model[g as usize][..],
            "gfn {g}"
        );
    }
}

#[test]
fn a_failed_swap_write_back_refuses_its_swap_outs_and_loses_nothing() {
    // Far under the guest's RAM: every cold page is wanted in the swap file.
    let cfg = cfg(Policy::aggressive(), Some(8 * PAGE_SIZE as u64));
    let mut r = Rig::with_swap(cfg, PAGES, 1 << 20).unwrap();
    // Random pages: neither shared, patched nor compressed; swapped raw.
    let mut rng = SmallRng::seed_from_u64(3);
    let mut model = Vec::new();
    for g in 0..PAGES {
        let mut p = vec![0u8; PAGE_SIZE];
        rng.fill(&mut p[..]);
        r.agent.write(Gfn(g), 0, &p).unwrap();
        model.push(p);
    }
    r.agent.shared.swap.file().fail_sync = true;
    // Every command memfoldd hands out is seen.
    for _ in 0..300 {
        r.step_seeing(10_000, |c| {
            if let Command::Stash { stash, .. } = c {
                assert_ne!(
                    stash.home,
                    BlobHome::Swap,
                    "a swap-out handed out after its swap file failed to sync"
                );
            }
        })
        .unwrap();
    }
    r.engine.check_invariants().unwrap();
    let b = vm_books(&r, r.vm);
    let sync_errors = r.engine.books().swap.sync_errors;
    assert!(sync_errors > 0, "the budget never asked for a swap-out");
    assert_eq!(
        b.swapped_pages, 0,
        "pages swapped out to a file that failed its sync"
    );
    assert!(b.stash_refused > 0, "{b:?}");
    for g in 0..PAGES {
        assert_eq!(
            r.agent.peek(Gfn(g)).unwrap()[..],
            model[g as usize][..],
            "gfn {g}"
        );
    }
    // The disk recovers: swapping resumes, and every byte still reads right.
    r.agent.shared.swap.file().fail_sync = false;
    for _ in 0..300 {
        r.step(10_000).unwrap();
    }
    r.engine.check_invariants().unwrap();
    assert!(
        vm_books(&r, r.vm).swapped_pages > 0,
        "no swap-out after the disk recovered"
    );
    reads_back(&mut r, &model);
}

/// A backing that refuses writes for a while (the store memfd out of memory; a swap
/// file on a full disk, which a QEMU can fill in `--swap-dir`) fails the blob, not the
/// page: the pages tried meanwhile are compressed once it writes again. Marking them as
/// pages neither patch nor compression fits (`de_failed`, cleared only by the guest's
/// write) left every cold page uncompressed for good.
#[test]
fn pages_tried_while_the_store_refused_writes_are_compressed_once_it_writes() {
    let mut r = Rig::new(cfg(Policy::difference_engine(), None), PAGES).unwrap();
    let model = text_pages(&mut r, "refused-write");
    r.agent.shared.store.file().fail_writes = true;
    for _ in 0..300 {
        r.step(10_000).unwrap();
    }
    assert!(
        r.engine.books().blob_write_errors > 0,
        "no write was refused"
    );
    assert_eq!(vm_books(&r, r.vm).compressed_pages, 0);
    r.agent.shared.store.file().fail_writes = false;
    for _ in 0..300 {
        r.step(10_000).unwrap();
    }
    r.engine.check_invariants().unwrap();
    let b = vm_books(&r, r.vm);
    assert!(
        b.compressed_pages + b.patched_pages > PAGES as u64 / 2,
        "pages left uncompressed after the store recovered: {b:?}"
    );
    reads_back(&mut r, &model);
}

/// A swap file whose write-back keeps failing is backed off from (1 s, doubling): each
/// failed `fdatasync` can block memfoldd's one loop for as long as the disk takes, and
/// every flush carrying swap-outs ran one. Cold pages meanwhile go to the store.
#[test]
fn a_swap_file_that_keeps_failing_its_write_back_is_backed_off_from() {
    let mut r = Rig::with_swap(cfg(Policy::aggressive(), Some(1)), PAGES, 1 << 20).unwrap();
    let model = text_pages(&mut r, "failing write-back");
    r.agent.shared.swap.file().fail_sync = true;
    // 6 s: with a back-off of 1, 2 and 4 s, at most 4 write-backs are tried.
    for _ in 0..600 {
        r.step(10_000).unwrap();
    }
    let s = r.engine.books().swap;
    assert!(
        (1..=4).contains(&s.sync_errors),
        "failed write-backs in 6 s: {s:?}"
    );
    r.engine.check_invariants().unwrap();
    assert!(
        vm_books(&r, r.vm).compressed_pages > 0,
        "nothing stored meanwhile"
    );
    reads_back(&mut r, &model);
}
