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

#[test]
fn a_failed_swap_write_back_refuses_its_swap_outs_and_loses_nothing() {
    let cfg = EngineConfig {
        policy: Policy::aggressive(),
        rate: 0,
        clock_interval_us: Some(100_000),
        min_scan_interval_us: 10_000,
        max_scan_interval_us: 10_000,
        // Far under the guest's RAM: every cold page is wanted in the swap file.
        host_budget: Some(8 * PAGE_SIZE as u64),
        ..EngineConfig::default()
    };
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
    for g in 0..PAGES {
        assert_eq!(
            r.agent.read(Gfn(g)).unwrap()[..],
            model[g as usize][..],
            "gfn {g}"
        );
    }
}

/// A backing that refuses writes for a while (the store memfd out of memory; a swap
/// file on a full disk, which a QEMU can fill in `--swap-dir`) fails the blob, not the
/// page: the pages tried meanwhile are compressed once it writes again. Marking them as
/// pages neither patch nor compression fits (`de_failed`, cleared only by the guest's
/// write) left every cold page uncompressed for good.
#[test]
fn pages_tried_while_the_store_refused_writes_are_compressed_once_it_writes() {
    let cfg = EngineConfig {
        policy: Policy::difference_engine(),
        rate: 0,
        clock_interval_us: Some(100_000),
        min_scan_interval_us: 10_000,
        max_scan_interval_us: 10_000,
        ..EngineConfig::default()
    };
    let mut r = Rig::new(cfg, PAGES).unwrap();
    // Text: every page compresses, no two alike.
    let mut model = Vec::new();
    for g in 0..PAGES {
        let line = format!("page {g} of the refused-write test, a line of its own; ");
        let p: Vec<u8> = line.bytes().cycle().take(PAGE_SIZE).collect();
        r.agent.write(Gfn(g), 0, &p).unwrap();
        model.push(p);
    }
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
    for g in 0..PAGES {
        assert_eq!(
            r.agent.read(Gfn(g)).unwrap()[..],
            model[g as usize][..],
            "gfn {g}"
        );
    }
}

/// A swap file whose write-back keeps failing is backed off from (1 s, doubling): each
/// failed `fdatasync` can block memfoldd's one loop for as long as the disk takes, and
/// every flush carrying swap-outs ran one. Cold pages meanwhile go to the store.
#[test]
fn a_swap_file_that_keeps_failing_its_write_back_is_backed_off_from() {
    let cfg = EngineConfig {
        policy: Policy::aggressive(),
        rate: 0,
        clock_interval_us: Some(100_000),
        min_scan_interval_us: 10_000,
        max_scan_interval_us: 10_000,
        host_budget: Some(1),
        ..EngineConfig::default()
    };
    let mut r = Rig::with_swap(cfg, PAGES, 1 << 20).unwrap();
    let mut model = Vec::new();
    for g in 0..PAGES {
        let line = format!("page {g} of the failing write-back test, its own line; ");
        let p: Vec<u8> = line.bytes().cycle().take(PAGE_SIZE).collect();
        r.agent.write(Gfn(g), 0, &p).unwrap();
        model.push(p);
    }
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
    for g in 0..PAGES {
        assert_eq!(
            r.agent.read(Gfn(g)).unwrap()[..],
            model[g as usize][..],
            "gfn {g}"
        );
    }
}
