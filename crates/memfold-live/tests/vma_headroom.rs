//! VMA headroom for CoW breaks (issue 14: "a CoW break inside a shared run needs VMAs no
//! budget reserved"). A run of guest pages shared onto consecutive frames is one mapping;
//! a CoW break in its middle maps guest RAM back over one page and makes it three, and a
//! CoW break cannot be refused. This test process plays QEMU with a small VMA budget:
//! region B is a copy of region A, so both share onto the same run of frames in few
//! mappings; then the guest writes every other page of both, the worst pattern. The
//! mappings must stay within the budget — the agent refused the shares it could not
//! afford, and breaks at the budget un-share whole runs — and every page must read what
//! was written.

mod common;

use std::time::Duration;

use common::{fast_engine, start_agent_with_budget, start_memfoldd, wait_for, GuestRam, PAGE};
use memfold_core::Policy;
use rand::{rngs::SmallRng, Rng, SeedableRng};

const HALF: usize = 700;

fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count()
}

#[test]
fn cow_breaks_inside_shared_runs_never_take_qemu_past_its_vma_budget() {
    let work = tempfile::tempdir().unwrap();
    let engine = memfold_core::EngineConfig {
        policy: Policy::sharing_only(),
        clock_interval_us: None,
        ..fast_engine()
    };
    let socket = start_memfoldd(work.path(), engine);
    let ram = GuestRam::new("headroom-ram", 2 * HALF);
    let mut rng = SmallRng::seed_from_u64(3);
    let mut want = vec![vec![0u8; PAGE]; 2 * HALF];
    for g in 0..HALF {
        rng.fill(&mut want[g][..]);
        want[HALF + g] = want[g].clone();
    }
    for (g, p) in want.iter().enumerate() {
        ram.write(g, 0, p);
    }
    // Room for about 600 pages on frames beyond what the process maps now: fewer than
    // the 1400 that could share.
    let budget = mappings() + 100 + 1200;
    start_agent_with_budget(&socket, "headroom", &ram, Some(budget));
    let vm = |s: &memfold_wire::stats::Stats| s.vms[0].shared_pages;
    wait_for(&socket, Duration::from_secs(30), "shares", |s| vm(s) >= 400);
    // Settled: every share memfoldd offers is taken or refused.
    let mut last = 0;
    loop {
        std::thread::sleep(Duration::from_millis(1500));
        let now = vm(&memfold_live::query_stats(&socket).unwrap());
        if now == last {
            break;
        }
        last = now;
    }
    // Its budget is in the statistics, as the operator sees it beside the count.
    wait_for(&socket, Duration::from_secs(10), "the VMA budget", |s| {
        s.vms[0].qemu_vma_budget == budget as u64 && s.vms[0].qemu_mappings > 0
    });

    // The worst pattern: a CoW break at every other page of both regions.
    let mut most = mappings();
    for g in (0..2 * HALF).step_by(2) {
        want[g][..8].copy_from_slice(&(g as u64).to_le_bytes());
        ram.write(g, 0, &want[g][..8]);
        most = most.max(mappings());
    }
    assert!(
        most <= budget,
        "{most} mappings after the CoW breaks, over the budget of {budget} ({last} pages were shared)"
    );
    // Not vacuous: the budget mattered.
    assert!(
        last < 2 * HALF as u64,
        "the budget held shares back: {last} shared"
    );
    let mut got = vec![0u8; PAGE];
    for (g, w) in want.iter().enumerate() {
        ram.read(g, &mut got);
        assert_eq!(&got, w, "gfn {g}");
    }
}
