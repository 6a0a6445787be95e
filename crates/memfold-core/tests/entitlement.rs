//! Sharing entitlements (Satori §4.2) in exact numbers: a guest's shared pages by the
//! sharing rank of their frames, and `s(i) = Σ (n − 1) / n`, as pages share and break.
//! Run on the engine memfoldd runs, with the in-memory agent (`memfold_core::sim::Rig`);
//! across guests and under random interleavings, `check_invariants` recounts the same
//! numbers from the P2Ms in the reference model.

use memfold_core::ids::Gfn;
use memfold_core::sim::Rig;
use memfold_core::{EngineConfig, Policy, SharingRanks, ZeroPolicy, PAGE_SIZE};

const PAGES: u32 = 64;

fn rig() -> Rig {
    let cfg = EngineConfig {
        policy: Policy::sharing_only(),
        zero: ZeroPolicy::Share,
        rate: 0,
        clock_interval_us: None,
        min_scan_interval_us: 10_000,
        max_scan_interval_us: 10_000,
        ..EngineConfig::default()
    };
    Rig::new(cfg, PAGES).unwrap()
}

fn settle(r: &mut Rig) {
    for _ in 0..20 {
        r.step(10_000).unwrap();
    }
    r.engine.check_invariants().unwrap();
}

/// A page of content `seed`, unlike any other seed's.
fn page(seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2654435761) | 1;
    (0..PAGE_SIZE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

fn ranks(r: &Rig) -> SharingRanks {
    r.engine.books().vms[0].sharing_ranks.clone()
}

#[test]
fn entitlement_is_the_sum_over_mappings_of_rank_minus_one_over_rank() {
    let mut r = rig();
    // Pages 0..4 hold A (rank 4), 4..6 hold B (rank 2), 6..10 are zero (the zero frame,
    // which earns nothing), the rest unique.
    for g in 0..PAGES {
        let p = match g {
            0..4 => page(1_000),
            4..6 => page(2_000),
            6..10 => vec![0; PAGE_SIZE],
            _ => page(g),
        };
        r.agent.write(Gfn(g), 0, &p).unwrap();
    }
    settle(&mut r);
    let s = ranks(&r);
    assert_eq!(s.0, vec![(2, 2), (4, 4)], "{s:?}");
    // 2 · 1/2 + 4 · 3/4 = 4 pages: exactly what sharing saves outside the zero frame.
    assert_eq!(s.entitlement_pages(), 4.0);
    assert_eq!(s.entitlement_bytes(), 4 * PAGE_SIZE as u64);
    let b = r.engine.books();
    assert_eq!(b.vms[0].books.zero_shared_pages, 4, "{b:#?}");

    // A write breaks one A page: A drops to rank 3 and every remaining mapper of A
    // earns less (Satori: "existing duplicates may be removed").
    r.agent.write(Gfn(0), 17, &[0xAB]).unwrap();
    settle(&mut r);
    let s = ranks(&r);
    assert_eq!(s.0, vec![(2, 2), (3, 3)], "{s:?}");
    assert_eq!(s.entitlement_pages(), 1.0 + 2.0);

    // Both B pages broken: B's frame is gone and its entitlement with it.
    r.agent.write(Gfn(4), 0, &page(4)).unwrap();
    r.agent.write(Gfn(5), 0, &page(5)).unwrap();
    settle(&mut r);
    let s = ranks(&r);
    assert_eq!(s.0, vec![(3, 3)], "{s:?}");
    assert_eq!(s.pages(), 3);
    assert_eq!(s.entitlement_pages(), 2.0);
}

#[test]
fn a_guest_sharing_nothing_is_entitled_to_nothing() {
    let mut r = rig();
    for g in 0..PAGES {
        r.agent.write(Gfn(g), 0, &page(g)).unwrap();
    }
    settle(&mut r);
    let s = ranks(&r);
    assert_eq!(s, SharingRanks::default());
    assert_eq!(s.entitlement_pages(), 0.0);
}
