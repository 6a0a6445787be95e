//! Exact counts, in the manner of the kernel's KSM selftests
//! (`tools/testing/selftests/mm/ksm_tests.c`, `ksm_functional_tests.c`): identical pages
//! merge onto one frame, a one-byte write unmerges exactly that page, zero pages are
//! reclaimed (or merged onto one zero frame), and the bytes stay right throughout. Run on
//! the engine memfoldd runs, with the in-memory agent (`memfold_core::sim::Rig`).

use memfold_core::ids::Gfn;
use memfold_core::sim::Rig;
use memfold_core::{EngineConfig, Policy, ZeroPolicy, PAGE_SIZE};

const PAGES: u32 = 64;

fn rig(zero: ZeroPolicy) -> Rig {
    let cfg = EngineConfig {
        policy: Policy::sharing_only(),
        zero,
        rate: 0,
        clock_interval_us: None,
        min_scan_interval_us: 10_000,
        max_scan_interval_us: 10_000,
        ..EngineConfig::default()
    };
    Rig::new(cfg, PAGES).unwrap()
}

/// Runs memfoldd for `ms` of simulated time.
fn settle(r: &mut Rig, ms: u64) {
    for _ in 0..ms / 10 {
        r.step(10_000).unwrap();
    }
    r.engine.check_invariants().unwrap();
}

fn page(byte: u8) -> Vec<u8> {
    (0..PAGE_SIZE).map(|i| byte ^ (i % 251) as u8).collect()
}

/// The Difference Engine with zero pages reclaimed, a clock interval of 100 ms and a full
/// scan every 10 ms.
fn de_config() -> EngineConfig {
    EngineConfig {
        policy: Policy::difference_engine(),
        zero: ZeroPolicy::Reclaim,
        rate: 0,
        clock_interval_us: Some(100_000),
        min_scan_interval_us: 10_000,
        max_scan_interval_us: 10_000,
        ..EngineConfig::default()
    }
}

/// A guest under the Difference Engine with data each mechanism takes, by `g % 4`: zeros,
/// one shared page, text unique to each page (compressed or patched); memfoldd has run
/// 3 s. Returns the rig and what each page holds.
fn de_rig_with_every_mechanism(word: &[u8; 15]) -> (Rig, Vec<Vec<u8>>) {
    let mut r = Rig::new(de_config(), PAGES).unwrap();
    let text = |g: u32| -> Vec<u8> {
        let mut p: Vec<u8> = (0..PAGE_SIZE).map(|i| word[i % 15]).collect();
        p[..4].copy_from_slice(&g.to_le_bytes());
        p
    };
    let want: Vec<Vec<u8>> = (0..PAGES)
        .map(|g| match g % 4 {
            0 => vec![0u8; PAGE_SIZE],
            1 => page(9),
            _ => text(g),
        })
        .collect();
    for (g, p) in want.iter().enumerate() {
        r.agent.write(Gfn(g as u32), 0, p).unwrap();
    }
    settle(&mut r, 3000);
    (r, want)
}

#[test]
fn identical_pages_merge_onto_one_frame_and_a_write_unmerges_exactly_one() {
    let mut r = rig(ZeroPolicy::Reclaim);
    for g in 0..PAGES {
        r.agent.write(Gfn(g), 0, &page(7)).unwrap();
    }
    settle(&mut r, 200);
    let b = r.engine.books();
    // KSM: pages_shared 1, pages_sharing PAGES - 1.
    assert_eq!((b.frames, b.mapped_pages), (1, PAGES as u64), "{b:#?}");
    assert_eq!(b.saved_pages, PAGES as i64 - 1);

    // A one-byte write unmerges that page alone.
    r.agent.write(Gfn(5), 100, &[0xAA]).unwrap();
    r.report();
    let b = r.engine.books();
    assert_eq!((b.frames, b.mapped_pages), (1, PAGES as u64 - 1), "{b:#?}");
    assert_eq!(b.vms[0].books.cow_breaks, 1);
    let mut want = page(7);
    want[100] = 0xAA;
    assert_eq!(r.agent.read(Gfn(5)).unwrap()[..], want[..]);
    for g in (0..PAGES).filter(|&g| g != 5) {
        assert_eq!(r.agent.read(Gfn(g)).unwrap()[..], page(7)[..], "gfn {g}");
    }

    // Every page written apart: nothing stays merged, the frame is freed.
    for g in 0..PAGES {
        r.agent.write(Gfn(g), 0, &page(g as u8 + 1)).unwrap();
    }
    r.report();
    settle(&mut r, 100);
    let b = r.engine.books();
    assert_eq!(
        (b.frames, b.mapped_pages, b.saved_pages),
        (0, 0, 0),
        "{b:#?}"
    );
}

#[test]
fn zero_pages_are_reclaimed_or_merged_onto_one_zero_frame() {
    // Reclaimed (memfold's default): no frame at all, refilled on the next touch.
    let mut r = rig(ZeroPolicy::Reclaim);
    for g in 0..PAGES {
        r.agent.write(Gfn(g), 0, &[0u8; PAGE_SIZE]).unwrap();
    }
    settle(&mut r, 200);
    let b = r.engine.books();
    assert_eq!(
        (b.zero_reclaimed_pages, b.frames),
        (PAGES as u64, 0),
        "{b:#?}"
    );
    assert_eq!(r.agent.read(Gfn(3)).unwrap()[..], [0u8; PAGE_SIZE][..]);
    r.report();
    assert_eq!(
        r.engine.books().zero_reclaimed_pages,
        PAGES as u64 - 1,
        "a touch refills one"
    );

    // Shared (KSM's use_zero_pages=0 way): all onto one frame.
    let mut r = rig(ZeroPolicy::Share);
    for g in 0..PAGES {
        r.agent.write(Gfn(g), 0, &[0u8; PAGE_SIZE]).unwrap();
    }
    settle(&mut r, 200);
    let b = r.engine.books();
    assert_eq!(
        (b.frames, b.mapped_pages, b.vms[0].books.zero_shared_pages),
        (1, PAGES as u64, PAGES as u64),
        "{b:#?}"
    );

    // Kept (Satori's argument): nothing.
    let mut r = rig(ZeroPolicy::Keep);
    for g in 0..PAGES {
        r.agent.write(Gfn(g), 0, &[0u8; PAGE_SIZE]).unwrap();
    }
    settle(&mut r, 200);
    assert_eq!(r.engine.books().saved_pages, 0);
}

/// The operator's opt-out of a whole guest, as KSM's `MADV_UNMERGEABLE` (or
/// `PR_SET_MEMORY_MERGE` 0) of a process: every merged page is unmerged, with memfold's
/// other mechanisms too — stored (patched, compressed) pages decoded back, reclaimed zero
/// pages handed back as holes — exact counts to zero, bytes unchanged, and nothing merged
/// again until the guest is opted back in.
#[test]
fn an_opted_out_guest_has_every_page_taken_back_and_none_merged_again() {
    let (mut r, want) = de_rig_with_every_mechanism(b"opted out text ");
    let b = r.engine.books().vms[0].books.clone();
    assert!(b.shared_pages > 0 && b.zero_reclaimed_pages > 0, "{b:#?}");
    assert!(b.compressed_pages + b.patched_pages > 0, "{b:#?}");

    let queued = r.engine.opt_out(r.vm).unwrap();
    assert_eq!(
        queued as u64,
        b.shared_pages
            + b.zero_reclaimed_pages
            + b.compressed_pages
            + b.patched_pages
            + b.unmapped_pages
    );
    settle(&mut r, 3000);
    let books = r.engine.books();
    let b = &books.vms[0].books;
    assert!(b.opted_out);
    assert_eq!(
        (
            b.shared_pages,
            b.zero_reclaimed_pages,
            b.patched_pages,
            b.compressed_pages,
            b.swapped_pages,
            b.unmapped_pages
        ),
        (0, 0, 0, 0, 0, 0),
        "{b:#?}"
    );
    assert_eq!(
        (books.frames, books.store_pages, books.saved_pages),
        (0, 0, 0)
    );
    for (g, p) in want.iter().enumerate() {
        assert_eq!(r.agent.peek(Gfn(g as u32)).unwrap()[..], p[..], "gfn {g}");
    }

    // Opted back in: memfold manages it again (its identical pages, cold by now, are
    // shared without a mapping).
    assert!(r.engine.opt_in(r.vm));
    settle(&mut r, 3000);
    let b = &r.engine.books().vms[0].books;
    assert!(
        !b.opted_out && b.shared_pages + b.unmapped_pages > 0,
        "{b:#?}"
    );
}

/// Opted out and back in, a guest has each mechanism take its pages again, patches
/// included: its near-duplicates find a new reference frame after the opt-out freed the
/// old ones. The data of memfold-live's opt-out test
/// ([`memfold_core::sim::every_mechanism_pages`]): zeros, one random page, near-duplicates
/// of it, text, random.
#[test]
fn an_opted_in_guest_has_every_mechanism_take_its_pages_again() {
    const N: u32 = 320;
    let mut r = Rig::new(de_config(), N).unwrap();
    let want = memfold_core::sim::every_mechanism_pages(N as usize, 11);
    for (g, p) in want.iter().enumerate() {
        r.agent.write(Gfn(g as u32), 0, p).unwrap();
    }
    let every = |r: &Rig| {
        let b = &r.engine.books().vms[0].books;
        b.shared_pages + b.unmapped_pages > 0
            && b.zero_reclaimed_pages > 0
            && b.patched_pages > 0
            && b.compressed_pages > 0
    };
    settle(&mut r, 3000);
    assert!(every(&r), "{:#?}", r.engine.books().vms[0].books);
    r.engine.opt_out(r.vm).unwrap();
    settle(&mut r, 3000);
    assert_eq!(r.engine.books().frames, 0);
    assert!(r.engine.opt_in(r.vm));
    settle(&mut r, 3000);
    assert!(every(&r), "{:#?}", r.engine.books().vms[0].books);
    for (g, p) in want.iter().enumerate() {
        assert_eq!(r.agent.peek(Gfn(g as u32)).unwrap()[..], p[..], "gfn {g}");
    }
}

/// A discarded range, as the KSM selftests' unmerge of a range dropped with
/// `MADV_DONTNEED` (QEMU's balloon and free page reporting punch guest RAM and drop its
/// mapping): every merged page in the range leaves its frame, every reclaimed or stored
/// one is released, exact counts, and the range reads as zeros; nothing outside it
/// changes. A discarded page is not a CoW break, a refill or a decode.
#[test]
fn a_discarded_range_is_unmerged_and_released_exactly() {
    let (mut r, want) = de_rig_with_every_mechanism(b"discarded text ");
    let before = r.engine.books().vms[0].books.clone();
    assert!(
        before.shared_pages > 4 && before.zero_reclaimed_pages > 4,
        "{before:#?}"
    );
    assert!(
        before.compressed_pages + before.patched_pages > 4,
        "{before:#?}"
    );

    // Discard the first half: count what memfold held there, by kind.
    let range = 0..PAGES / 2;
    let (mut shared, mut zero, mut stored) = (0, 0, 0);
    for g in range.clone() {
        match r.agent.home(Gfn(g)) {
            memfold_core::sim::Home::Frame(_) => shared += 1,
            memfold_core::sim::Home::Zero => zero += 1,
            memfold_core::sim::Home::Stashed(_) => stored += 1,
            memfold_core::sim::Home::Private => {}
        }
        r.agent.discard(Gfn(g));
    }
    assert!(shared > 0 && zero > 0 && stored > 0);
    r.report();
    r.engine.check_invariants().unwrap();
    let b = r.engine.books().vms[0].books.clone();
    assert_eq!(b.discards, shared + zero + stored, "{b:#?}");
    // No-copy-on-write: every shared page discarded is a copy the guest's next write no
    // longer needs (Satori §4.3).
    assert_eq!(b.cow_copies_avoided, shared, "{b:#?}");
    assert_eq!(b.shared_pages, before.shared_pages - shared);
    assert_eq!(b.zero_reclaimed_pages, before.zero_reclaimed_pages - zero);
    assert_eq!(
        b.compressed_pages + b.patched_pages + b.swapped_pages,
        before.compressed_pages + before.patched_pages + before.swapped_pages - stored
    );
    // Not accesses: no CoW breaks, refills or decodes counted.
    assert_eq!(
        (b.cow_breaks, b.refills, b.unstashes),
        (before.cow_breaks, before.refills, before.unstashes)
    );
    for g in 0..PAGES {
        let got = r.agent.peek(Gfn(g)).unwrap();
        if range.contains(&g) {
            assert_eq!(
                got[..],
                [0u8; PAGE_SIZE][..],
                "discarded gfn {g} reads zeros"
            );
        } else {
            assert_eq!(got[..], want[g as usize][..], "gfn {g} unchanged");
        }
    }
    // The whole guest discarded: nothing held, no frame, no blob.
    for g in 0..PAGES {
        r.agent.discard(Gfn(g));
    }
    r.report();
    let books = r.engine.books();
    let b = &books.vms[0].books;
    assert_eq!(
        (
            b.shared_pages,
            b.zero_reclaimed_pages,
            b.patched_pages,
            b.compressed_pages
        ),
        (0, 0, 0, 0),
        "{b:#?}"
    );
    assert_eq!((books.frames, books.store_pages), (0, 0), "{books:#?}");
}
