//! Unit tests per mechanism with hand-made pages and their edge cases.

use memfold_core::{
    Access, CompressCodec, CompressOutcome, Engine, EngineConfig, EngineError, MemSwapDevice,
    PageState, PatchCodec, PatchOutcome, Policy, ShareOutcome, SwapOutcome, VmId, ZeroPolicy,
    PAGE_SIZE,
};
use rand::{rngs::SmallRng, Rng, SeedableRng};

fn engine(cfg: EngineConfig) -> Engine {
    Engine::new(cfg, Box::new(MemSwapDevice::new(64))).unwrap()
}

/// The defaults with one share pass (identical pages found in one sweep) and no rest
/// between sweeps, so that tests count sweeps exactly.
fn cfg() -> EngineConfig {
    EngineConfig {
        min_rescan_us: 0,
        share_passes: 1,
        ..EngineConfig::default()
    }
}

fn random_page(seed: u64) -> Vec<u8> {
    let mut p = vec![0u8; PAGE_SIZE];
    SmallRng::seed_from_u64(seed).fill(&mut p[..]);
    p
}

fn similar_to(base: &[u8], seed: u64, runs: usize) -> Vec<u8> {
    let mut p = base.to_vec();
    let mut r = SmallRng::seed_from_u64(seed);
    for _ in 0..runs {
        let at = r.gen_range(0..PAGE_SIZE - 8);
        r.fill(&mut p[at..at + 8]);
    }
    p
}

fn text_page(seed: u64) -> Vec<u8> {
    let words: [&[u8]; 4] = [b"guest ", b"frame ", b"share ", b"page\n"];
    let mut r = SmallRng::seed_from_u64(seed);
    let mut p = Vec::with_capacity(PAGE_SIZE + 8);
    while p.len() < PAGE_SIZE {
        p.extend_from_slice(words[r.gen_range(0..4)]);
    }
    p.truncate(PAGE_SIZE);
    p
}

fn read_page(e: &mut Engine, vm: VmId, gfn: u32) -> Vec<u8> {
    let mut b = vec![0u8; PAGE_SIZE];
    e.read(vm, gfn, 0, &mut b).unwrap();
    b
}

#[test]
fn identical_pages_share_across_and_within_vms_and_cow_break_on_write() {
    let mut e = engine(cfg());
    let (a, b) = (e.create_vm(4).unwrap(), e.create_vm(4).unwrap());
    let page = random_page(1);
    for (vm, gfn) in [(a, 0), (a, 1), (b, 2)] {
        assert_eq!(e.write(vm, gfn, 0, &page).unwrap(), Access::ZeroFill);
    }
    assert_eq!(e.try_share(a, 0).unwrap(), ShareOutcome::Hinted);
    assert_eq!(
        e.try_share(a, 1).unwrap(),
        ShareOutcome::Shared,
        "within a VM"
    );
    assert_eq!(
        e.try_share(b, 2).unwrap(),
        ShareOutcome::Shared,
        "across VMs"
    );
    let PageState::Shared(f) = e.page_state(a, 0).unwrap() else {
        panic!()
    };
    assert_eq!(e.page_state(b, 2).unwrap(), PageState::Shared(f));
    let acc = e.accounting();
    assert_eq!(
        (acc.frames.in_use, acc.frames.shared, acc.pages.shared),
        (1, 1, 3)
    );
    assert_eq!(acc.saved.sharing, 2.0 * PAGE_SIZE as f64);
    // Reads are free.
    assert_eq!(e.read(b, 2, 0, &mut [0u8; 16]).unwrap(), Access::Hit);
    // A partial write breaks sharing and keeps the rest of the page.
    assert_eq!(e.write(b, 2, 100, &[9, 9]).unwrap(), Access::CowBreak);
    let mut expect = page.clone();
    expect[100..102].copy_from_slice(&[9, 9]);
    assert_eq!(read_page(&mut e, b, 2), expect);
    assert_eq!(read_page(&mut e, a, 0), page, "other sharers untouched");
    // The last two sharers: one breaks with a copy, the last takes the frame back.
    e.write(a, 0, 0, &[1]).unwrap();
    assert_eq!(e.counters().cow_reuses, 0);
    e.write(a, 1, 0, &[2]).unwrap();
    assert_eq!(e.counters().cow_reuses, 1);
    assert_eq!(e.page_state(a, 1).unwrap(), PageState::Private(f));
    e.check_invariants().unwrap();
    e.destroy_vm(a).unwrap();
    e.destroy_vm(b).unwrap();
    assert_eq!(e.accounting().frames.in_use, 0);
}

#[test]
fn forced_hash_collisions_never_share_different_pages() {
    let mut c = cfg();
    c.page_hash = |_| 7; // every page collides
    let mut e = engine(c);
    let vm = e.create_vm(8).unwrap();
    let (p, q) = (random_page(1), random_page(2));
    for (g, page) in [(0, &p), (1, &q), (2, &p), (3, &q)] {
        e.write(vm, g, 0, page).unwrap();
    }
    for g in 0..4 {
        e.try_share(vm, g).unwrap();
    }
    assert_eq!(read_page(&mut e, vm, 0), p);
    assert_eq!(read_page(&mut e, vm, 1), q);
    assert_eq!(read_page(&mut e, vm, 2), p);
    assert_eq!(read_page(&mut e, vm, 3), q);
    assert!(e.counters().hash_false_matches > 0);
    // Identical pages still find each other through the chain.
    assert_eq!(e.counters().shares, 2);
    e.check_invariants().unwrap();
}

#[test]
fn zero_pages_follow_the_policy_switch() {
    for (policy, expect) in [
        (ZeroPolicy::Reclaim, ShareOutcome::ZeroReclaimed),
        (ZeroPolicy::AsContent, ShareOutcome::Shared),
        (ZeroPolicy::Never, ShareOutcome::NotEligible),
    ] {
        let mut e = engine(EngineConfig {
            zero_pages: policy,
            ..cfg()
        });
        let vm = e.create_vm(4).unwrap();
        e.write(vm, 0, 0, &[1]).unwrap();
        e.write(vm, 0, 0, &[0]).unwrap(); // now all zeros, but backed
        e.write(vm, 1, 0, &[0]).unwrap();
        let first = e.try_share(vm, 0).unwrap();
        let second = e.try_share(vm, 1).unwrap();
        assert_eq!(second, expect, "{policy:?} (first: {first:?})");
        assert_eq!(read_page(&mut e, vm, 1), vec![0u8; PAGE_SIZE]);
        e.write(vm, 1, 5, &[3]).unwrap();
        assert_eq!(read_page(&mut e, vm, 1)[5], 3);
        assert_eq!(read_page(&mut e, vm, 0), vec![0u8; PAGE_SIZE]);
        e.check_invariants().unwrap();
    }
}

#[test]
fn unbacked_pages_read_zero_and_cost_nothing() {
    let mut e = engine(cfg());
    let vm = e.create_vm(1000).unwrap();
    assert_eq!(read_page(&mut e, vm, 999), vec![0u8; PAGE_SIZE]);
    let acc = e.accounting();
    assert_eq!(
        (acc.baseline_bytes, acc.host_bytes, acc.pages.unbacked),
        (0, 0, 1000)
    );
    assert!(matches!(
        e.read(vm, 1000, 0, &mut [0]),
        Err(EngineError::GfnOutOfRange { pages: 1000, .. })
    ));
    assert!(matches!(
        e.write(vm, 0, 4090, &[0; 7]),
        Err(EngineError::BadAccess {
            offset: 4090,
            len: 7,
            ..
        })
    ));
    assert!(matches!(
        e.read(VmId(77), 0, 0, &mut [0]),
        Err(EngineError::NoSuchVm(VmId(77)))
    ));
    assert!(matches!(e.create_vm(0), Err(EngineError::BadVmSize { .. })));
}

#[test]
fn similar_pages_are_patched_and_rebuilt_on_access() {
    for codec in PatchCodec::ALL {
        let mut e = engine(EngineConfig {
            patch_codec: codec,
            ..cfg()
        });
        let vm = e.create_vm(8).unwrap();
        let base = random_page(3);
        let sim = similar_to(&base, 4, 10);
        e.write(vm, 0, 0, &base).unwrap();
        e.write(vm, 1, 0, &sim).unwrap();
        assert!(e.index_reference(vm, 0).unwrap());
        let PatchOutcome::Patched(len) = e.try_patch(vm, 1).unwrap() else {
            panic!("{codec:?} did not patch")
        };
        assert!(len < 400, "{codec:?} patch of {len} bytes");
        assert!(matches!(
            e.page_state(vm, 1).unwrap(),
            PageState::Patched(_)
        ));
        assert!(
            matches!(e.page_state(vm, 0).unwrap(), PageState::Shared(_)),
            "reference frozen"
        );
        let acc = e.accounting();
        assert!(acc.saved.patching > 3000.0, "{:?}", acc.saved);
        assert_eq!(e.read(vm, 1, 0, &mut [0u8; 4]).unwrap(), Access::Unpatch);
        assert_eq!(read_page(&mut e, vm, 1), sim);
        e.check_invariants().unwrap();
    }
}

#[test]
fn writing_a_reference_page_never_corrupts_its_patches() {
    let mut e = engine(cfg());
    let vm = e.create_vm(8).unwrap();
    let base = random_page(5);
    let sims: Vec<_> = (0..3).map(|i| similar_to(&base, 10 + i, 5)).collect();
    e.write(vm, 0, 0, &base).unwrap();
    e.index_reference(vm, 0).unwrap();
    for (i, s) in sims.iter().enumerate() {
        e.write(vm, 1 + i as u32, 0, s).unwrap();
        assert!(matches!(
            e.try_patch(vm, 1 + i as u32).unwrap(),
            PatchOutcome::Patched(_)
        ));
    }
    // The reference page is rewritten entirely, then discarded.
    assert_eq!(
        e.write(vm, 0, 0, &random_page(99)).unwrap(),
        Access::CowBreak
    );
    let acc = e.accounting();
    assert_eq!(
        acc.frames.reference_only, 1,
        "old content kept for the patches"
    );
    e.check_invariants().unwrap();
    e.discard(vm, 0).unwrap();
    for (i, s) in sims.iter().enumerate() {
        let mut out = [0u8; PAGE_SIZE];
        e.peek(vm, 1 + i as u32, &mut out).unwrap();
        assert_eq!(&out[..], &s[..]);
    }
    // When the last patch goes, the reference frame goes too.
    for i in 0..3 {
        e.write(vm, 1 + i, 0, &[0u8; PAGE_SIZE]).unwrap();
    }
    e.check_invariants().unwrap();
    assert_eq!(e.accounting().frames.reference_only, 0);
}

#[test]
fn patches_over_the_cut_off_are_refused() {
    let mut e = engine(EngineConfig {
        patch_cutoff: 2048,
        ..cfg()
    });
    let vm = e.create_vm(4).unwrap();
    let base = random_page(6);
    // Unrelated except for the hashed blocks: a candidate, but its patch is huge.
    let mut far = random_page(7);
    let det = memfold_core::similarity::SimilarityDetector::new(e.config().similarity).unwrap();
    for &b in det.blocks() {
        let r = b as usize * 64..b as usize * 64 + 64;
        far[r.clone()].copy_from_slice(&base[r]);
    }
    e.write(vm, 0, 0, &base).unwrap();
    e.index_reference(vm, 0).unwrap();
    e.write(vm, 1, 0, &far).unwrap();
    assert_eq!(e.try_patch(vm, 1).unwrap(), PatchOutcome::TooLarge);
    assert_eq!(e.counters().patch_rejected, 1);
    assert!(matches!(
        e.page_state(vm, 1).unwrap(),
        PageState::Private(_)
    ));
    e.write(vm, 2, 0, &random_page(8)).unwrap();
    assert_eq!(e.try_patch(vm, 2).unwrap(), PatchOutcome::NoCandidate);
}

#[test]
fn every_compression_codec_round_trips_through_the_engine() {
    for codec in CompressCodec::ALL {
        let mut e = engine(EngineConfig {
            compress_codec: codec,
            ..cfg()
        });
        let vm = e.create_vm(4).unwrap();
        // Small integers: compressible by every codec, byte- or word-oriented.
        let mut words = vec![0u8; PAGE_SIZE];
        for (i, w) in words.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&((i as u64 * 7) % 300).to_le_bytes());
        }
        let pages = [text_page(1), words, random_page(2)];
        for (g, p) in pages.iter().enumerate() {
            e.write(vm, g as u32, 0, p).unwrap();
        }
        assert!(
            matches!(
                e.try_compress(vm, 0).unwrap(),
                CompressOutcome::Compressed(_)
            ) || codec == CompressCodec::Wkdm
        );
        assert!(
            matches!(
                e.try_compress(vm, 1).unwrap(),
                CompressOutcome::Compressed(_)
            ),
            "{codec:?}"
        );
        assert_eq!(
            e.try_compress(vm, 2).unwrap(),
            CompressOutcome::TooLarge,
            "random pages stay"
        );
        for (g, p) in pages.iter().enumerate() {
            let mut out = [0u8; PAGE_SIZE];
            e.peek(vm, g as u32, &mut out).unwrap();
            assert_eq!(&out[..], &p[..], "{codec:?} page {g}");
        }
        assert_eq!(e.read(vm, 1, 0, &mut [0u8; 8]).unwrap(), Access::Decompress);
        e.check_invariants().unwrap();
    }
}

#[test]
fn swap_out_and_in_of_every_page_kind_with_full_swap_and_io_errors() {
    let dev = MemSwapDevice::new(3);
    let faults = dev.faults();
    let mut e = Engine::new(cfg(), Box::new(dev)).unwrap();
    let vm = e.create_vm(8).unwrap();
    let base = random_page(1);
    let pages = [
        base.clone(),
        similar_to(&base, 2, 3),
        text_page(3),
        base.clone(),
        random_page(4),
    ];
    for (g, p) in pages.iter().enumerate() {
        e.write(vm, g as u32, 0, p).unwrap();
    }
    e.index_reference(vm, 0).unwrap();
    assert!(matches!(
        e.try_patch(vm, 1).unwrap(),
        PatchOutcome::Patched(_)
    ));
    assert!(matches!(
        e.try_compress(vm, 2).unwrap(),
        CompressOutcome::Compressed(_)
    ));
    assert_eq!(e.try_share(vm, 3).unwrap(), ShareOutcome::Shared);
    for g in [1, 2, 3] {
        assert!(
            matches!(e.swap_out(vm, g).unwrap(), SwapOutcome::Swapped(_)),
            "gfn {g}"
        );
    }
    // Full: a hint, nothing changes.
    assert_eq!(e.swap_out(vm, 4).unwrap(), SwapOutcome::SwapFull);
    assert!(matches!(
        e.page_state(vm, 4).unwrap(),
        PageState::Private(_)
    ));
    // A failing read leaves the page swapped and intact.
    faults
        .reads
        .store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(matches!(
        e.read(vm, 1, 0, &mut [0u8; 4]),
        Err(EngineError::SwapIo(_))
    ));
    assert!(matches!(
        e.page_state(vm, 1).unwrap(),
        PageState::Swapped(_)
    ));
    faults
        .reads
        .store(false, std::sync::atomic::Ordering::Relaxed);
    for (g, p) in pages.iter().enumerate() {
        assert_eq!(&read_page(&mut e, vm, g as u32), p, "gfn {g}");
    }
    assert_eq!(e.counters().swap_ins, 3);
    // A failing write leaves the page in memory.
    faults
        .writes
        .store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(matches!(e.swap_out(vm, 4), Err(EngineError::SwapIo(_))));
    assert!(matches!(
        e.page_state(vm, 4).unwrap(),
        PageState::Private(_)
    ));
    assert_eq!(e.accounting().swap.in_use, 0);
    e.check_invariants().unwrap();
}

#[test]
fn a_host_budget_overcommits_through_swap_and_fails_cleanly_when_swap_is_full() {
    let mut e = Engine::new(
        EngineConfig {
            host_frames_limit: Some(10),
            ..cfg()
        },
        Box::new(MemSwapDevice::new(20)),
    )
    .unwrap();
    let vm = e.create_vm(40).unwrap();
    for g in 0..30 {
        e.write(vm, g, 0, &random_page(g as u64)).unwrap();
        assert!(e.accounting().frames.in_use <= 10);
    }
    assert!(e.counters().swap_outs >= 20);
    for g in 0..30 {
        assert_eq!(read_page(&mut e, vm, g), random_page(g as u64), "gfn {g}");
    }
    // 10 in memory + 20 in swap: the 31st page has nowhere to go.
    let err = e.write(vm, 30, 0, &random_page(30)).unwrap_err();
    assert!(
        matches!(err, EngineError::OutOfHostMemory { limit: 10, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("swap file is full"), "{err}");
    assert_eq!(e.page_state(vm, 30).unwrap(), PageState::Unbacked);
    e.check_invariants().unwrap();
}

#[test]
fn the_clock_applies_the_de_policy_by_class() {
    let mut e = engine(cfg());
    let vm = e.create_vm(64).unwrap();
    let base = random_page(1);
    for g in 0..16 {
        e.write(vm, g, 0, &base).unwrap(); // identical
    }
    for g in 16..32 {
        e.write(vm, g, 0, &similar_to(&base, g as u64, 4)).unwrap(); // similar
    }
    for g in 32..48 {
        e.write(vm, g, 0, &text_page(g as u64)).unwrap(); // compressible
    }
    // Sweep 1: everything just written (C1): nothing happens.
    let r = e.tick(0, 64).unwrap();
    assert_eq!(r.states[0], 48);
    assert_eq!(
        r.shared + r.patched + r.compressed,
        0,
        "C1 pages are left alone"
    );
    // Sweep 2 (C3): shared and patched. Sweep 3 (C4): compressed.
    e.tick(1, 64).unwrap();
    let acc = e.accounting();
    // The similar pages' reference is the identical pages' shared frame.
    assert_eq!(acc.pages.shared, 16);
    assert!(acc.pages.patched >= 14, "{:?}", acc.pages);
    assert_eq!(
        acc.pages.compressed, 0,
        "compression waits for a full idle cycle"
    );
    e.tick(2, 64).unwrap();
    e.tick(3, 64).unwrap();
    let acc = e.accounting();
    assert_eq!(acc.pages.compressed, 16, "{:?}", acc.pages);
    // 15/16 of the identical and ~15/16 of the similar pages, about half of each text page.
    assert!(acc.saved_fraction() > 0.75, "{}", acc.saved_fraction());
    // Sharing-only touches nothing but identical pages.
    let mut s = engine(EngineConfig {
        policy: Policy::sharing_only(),
        ..cfg()
    });
    let vm2 = s.create_vm(8).unwrap();
    s.write(vm2, 0, 0, &base).unwrap();
    s.write(vm2, 1, 0, &similar_to(&base, 1, 2)).unwrap();
    s.write(vm2, 2, 0, &text_page(1)).unwrap();
    for t in 0..6 {
        s.tick(t, 8).unwrap();
    }
    let acc = s.accounting();
    assert_eq!(
        (acc.pages.patched, acc.pages.compressed, acc.pages.private),
        (0, 0, 3)
    );
}

#[test]
fn the_clock_rests_min_rescan_between_sweeps_and_is_fair_between_vms() {
    let mut e = engine(EngineConfig {
        min_rescan_us: 4_000_000,
        ..cfg()
    });
    let a = e.create_vm(100).unwrap();
    let b = e.create_vm(100).unwrap();
    let r = e.tick(0, 50).unwrap();
    assert_eq!(r.scanned, 50);
    // Both VMs advanced by half.
    e.note_access(a, 0, true, false).unwrap();
    let r = e.tick(0, 150).unwrap();
    assert_eq!(r.scanned, 150, "finishes both sweeps");
    let r = e.tick(1_000_000, 100).unwrap();
    assert_eq!((r.scanned, r.vms_resting), (0, 2), "4 s not over");
    let r = e.tick(4_000_000, 100).unwrap();
    assert_eq!(r.scanned, 100);
    assert!(e.page_clock(b, 0).unwrap().idle_scans() >= 1);
}

#[test]
fn five_pass_partitioning_shares_everything_over_a_cycle_with_a_smaller_table() {
    let mk = |passes| {
        let mut e = engine(EngineConfig {
            share_passes: passes,
            policy: Policy::sharing_only(),
            ..cfg()
        });
        let vm = e.create_vm(400).unwrap();
        for g in 0..400 {
            e.write(vm, g, 0, &random_page((g % 100) as u64)).unwrap();
        }
        (e, vm)
    };
    let (mut one, _) = mk(1);
    let (mut five, _) = mk(5);
    let mut max_table = [0usize; 2];
    for t in 0..8 {
        one.tick(t, 400).unwrap();
        five.tick(t, 400).unwrap();
        max_table[0] = max_table[0].max(one.metadata().share_table as usize);
        max_table[1] = max_table[1].max(five.metadata().share_table as usize);
    }
    assert_eq!(one.accounting().pages.shared, 400);
    assert_eq!(
        five.accounting().pages.shared,
        400,
        "a full cycle covers every hash interval"
    );
    assert!(five.counters().cycles >= 1);
    assert!(
        max_table[1] < max_table[0],
        "partitioned table {} vs {}",
        max_table[1],
        max_table[0]
    );
    five.check_invariants().unwrap();
}

#[test]
fn metadata_stays_under_half_a_percent_of_managed_memory() {
    // The shipped defaults (5 share passes, DE §4.3).
    let mut e = engine(EngineConfig {
        min_rescan_us: 0,
        ..EngineConfig::default()
    });
    let vm = e.create_vm(32768).unwrap(); // 128 MiB
    let base = random_page(1);
    for g in 0..32768u32 {
        let p = match g % 4 {
            0 => base.clone(),
            1 => similar_to(&base, g as u64, 4),
            2 => text_page(g as u64),
            _ => random_page(g as u64),
        };
        e.write(vm, g, 0, &p).unwrap();
    }
    let mut peak = e.metadata();
    for t in 0..12 {
        e.tick(t, 32768).unwrap();
        let m = e.metadata();
        if m.total > peak.total {
            peak = m;
        }
    }
    let acc = e.accounting();
    assert!(
        acc.pages.shared > 0 && acc.pages.patched > 0 && acc.pages.compressed > 0,
        "{:?}",
        acc.pages
    );
    let m = peak;
    println!("{m:#?}");
    assert!(
        m.fraction < 0.005,
        "metadata {:.3}% of managed memory",
        m.fraction * 100.0
    );
}
