//! Tests of sharing without a mapping (split from unmapped.rs, which was over 800 lines).

use super::*;
use crate::sim::{quick_config, Home, Rig};
use crate::{EngineConfig, Policy, PAGE_SIZE};

const PAGES: u32 = 16;

fn cfg(on: bool) -> EngineConfig {
    EngineConfig {
        share_cold_unmapped: on,
        ..quick_config(Policy::difference_engine())
    }
}

/// Bytes unique to `seed` (random-looking: neither patched nor compressed under the
/// cut-offs against one another... mostly; what matters is that no two are equal).
fn page(seed: u32) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ seed as u64;
    (0..PAGE_SIZE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// `ms` of memfoldd, 10 ms a step; pages `hot` are read by the guest every step.
fn settle(r: &mut Rig, ms: u64, hot: &[u32]) {
    for _ in 0..ms / 10 {
        for &g in hot {
            r.agent.read(Gfn(g)).unwrap();
        }
        r.step(10_000).unwrap();
    }
    r.engine.check_invariants().unwrap();
}

/// A guest of unique pages, settled (all cold), but for pages 8–9, equal to each
/// other and read all the time (mapped onto a frame of their own); then pages 0–3
/// (left alone) and 4–5 (read all the time) are written with one content, and pages
/// 12–13 (left alone) with another.
fn rig(on: bool) -> Rig {
    rig_with(cfg(on))
}

fn rig_with(cfg: EngineConfig) -> Rig {
    let mut r = Rig::new(cfg, PAGES).unwrap();
    for g in 0..PAGES {
        let seed = if g == 8 || g == 9 { 8 } else { 100 + g };
        r.agent.write(Gfn(g), 0, &page(seed)).unwrap();
    }
    settle(&mut r, 1000, &[8, 9]);
    for g in 0..6 {
        r.agent.write(Gfn(g), 0, &page(7)).unwrap();
    }
    for g in 12..14 {
        r.agent.write(Gfn(g), 0, &page(12)).unwrap();
    }
    settle(&mut r, 1500, &[4, 5, 8, 9]);
    r
}

fn state(r: &Rig, g: u32) -> PageState {
    r.engine.page_state(r.vm, Gfn(g)).unwrap()
}

/// Seed of page `g` of a guest whose first `twins` pages are equal, the rest unique.
fn seed(g: u32, twins: u32) -> u32 {
    if g < twins {
        7
    } else {
        100 + g
    }
}

/// A guest written with [`seed`]'s pages, not yet settled.
fn with_twins(on: bool, twins: u32) -> Rig {
    let mut r = Rig::new(cfg(on), PAGES).unwrap();
    for g in 0..PAGES {
        r.agent.write(Gfn(g), 0, &page(seed(g, twins))).unwrap();
    }
    r
}

/// The agent refused a share just now: VMA pressure for [`VMA_PRESSURE_US`].
fn press(r: &mut Rig) {
    r.engine.vms.get_mut(&r.vm).unwrap().share_refused_us = Some(r.engine.now_us());
}

#[test]
fn cold_identical_pages_are_shared_without_a_mapping_hot_ones_mapped() {
    let r = rig(true);
    let PageState::Shared(f) = state(&r, 4) else {
        panic!("hot page 4 is {:?}", state(&r, 4));
    };
    assert_eq!(state(&r, 5), PageState::Shared(f));
    for g in 0..4 {
        assert_eq!(
            state(&r, g),
            PageState::Unmapped(f),
            "cold page {g}: against the hot pages' frame"
        );
        assert!(matches!(r.agent.home(Gfn(g)), Home::Stashed(_)));
        assert_eq!(r.agent.peek(Gfn(g)).unwrap()[..], page(7)[..]);
    }
    let dom = r.engine.domain(DomainId(0));
    assert_eq!((dom.frames.refcount(f), dom.frames.patch_refs(f)), (6, 4));
    // Two cold pages equal to each other alone: both on one frame, neither mapped.
    let refs: Vec<_> = (12..14)
        .map(|g| match state(&r, g) {
            PageState::Unmapped(f) => f,
            s => panic!("cold page {g} is {s:?}"),
        })
        .collect();
    let f2 = refs[0];
    assert_eq!(refs[1], f2);
    // No blob record is left for any of them (issue 19: 24 bytes a page).
    assert!(r.engine.blobs.is_empty(), "{} blobs", r.engine.blobs.len());
    assert_eq!((dom.frames.refcount(f2), dom.frames.patch_refs(f2)), (2, 2));
    let b = r.engine.books();
    let v = &b.vms[0].books;
    assert_eq!(
        (v.unmapped_pages, v.unmapped_shares, v.shared_pages),
        (6, 6, 4)
    );
    assert_eq!(v.patched_pages, 0, "booked as sharing, not patching");
    // 6 guest pages on one frame, 2 on another, 2 on a third held by patches alone;
    // 6 slots of 64 bytes round to 0 pages.
    assert_eq!(b.saved_by.sharing, 7);
    assert_eq!(b.saved_by.patching, 0);
    assert_eq!(b.unmapped_pages, 6);
}

/// Pages shared without a mapping keep their entitlement (Satori §4.2), and their
/// mapped partners theirs: the frame holds every one of them. Before, an unmapped
/// page earned nothing and left its frame's rank: the 4 cold pages on the hot pair's
/// frame took the pair from rank 6 to rank 2, and the guest's entitlement from 7
/// pages (what sharing saves) to 2 — a balloon inflated for sharing that never broke.
#[test]
fn pages_shared_without_a_mapping_keep_their_entitlement() {
    let r = rig(true);
    let b = r.engine.books();
    assert_eq!(b.saved_by.sharing, 7);
    let ranks = &b.vms[0].sharing_ranks;
    assert_eq!(ranks.0, vec![(2, 4), (6, 6)]);
    assert_eq!(ranks.entitlement_pages(), 7.0);
    assert_eq!(r.engine.sharing_ranks(r.vm).as_ref(), Some(ranks));
}

/// Two cold pages equal to each other, which the scan finds but leaves to the clock,
/// are shared by the clock's slice however many scans later it comes: the hint is
/// kept (`at_read::KEPT_HINTS`). With quiet pages hinted one scan in 5 (DE §4.3's
/// passes), the hint was gone by then without it, and both pages stayed private.
#[test]
fn a_pair_left_to_the_clock_keeps_its_hint_until_the_clock_shares_it() {
    let mut r = rig_with(EngineConfig {
        share_passes: 5,
        ..cfg(true)
    });
    let (a, b) = (state(&r, 12), state(&r, 13));
    assert!(matches!(a, PageState::Unmapped(_)) && a == b, "{a:?} {b:?}");
    // Kept once at most, and gone once shared (at the next scan's start).
    let kept = |r: &Rig| -> usize { r.engine.kept_hints.values().map(|k| k.len()).sum() };
    assert!(kept(&r) <= 1, "{} kept", kept(&r));
    r.step(10_000).unwrap();
    r.step(10_000).unwrap();
    assert_eq!(kept(&r), 0);
    r.engine.check_invariants().unwrap();
}

/// A page shared without a mapping that its guest marks never-share (Satori §4.3) is
/// taken back, and so is the other page on its frame; neither is shared again, and
/// every byte is intact.
#[test]
fn an_unmapped_page_marked_never_share_is_taken_back_with_its_frame() {
    let mut r = rig(true);
    let PageState::Unmapped(f2) = state(&r, 12) else {
        panic!("page 12 is {:?}", state(&r, 12));
    };
    let report = crate::sim::anon_report(PAGES, &[12]);
    r.engine.guest_categories(r.vm, &report).unwrap();
    assert!(r.engine.withdrawn(DomainId(0), f2));
    settle(&mut r, 3000, &[4, 5, 8, 9]);
    for g in 12..14 {
        assert!(
            !matches!(state(&r, g), PageState::Unmapped(_) | PageState::Shared(_)),
            "page {g} is {:?}",
            state(&r, g)
        );
        assert_eq!(r.agent.peek(Gfn(g)).unwrap()[..], page(12)[..]);
    }
    // The other cold pages stay unmapped.
    assert!(matches!(state(&r, 0), PageState::Unmapped(_)));
}

/// The operator's opt-out takes back pages shared without a mapping too: none is left
/// punched, no frame reference stays, every byte is intact.
#[test]
fn an_opt_out_takes_back_unmapped_pages() {
    let mut r = rig(true);
    assert!(r.engine.books().vms[0].books.unmapped_pages >= 6);
    r.engine.opt_out(r.vm).unwrap();
    settle(&mut r, 500, &[]);
    for g in 0..PAGES {
        assert!(
            !matches!(state(&r, g), PageState::Unmapped(_) | PageState::Shared(_)),
            "page {g} is {:?}",
            state(&r, g)
        );
    }
    assert_eq!(r.engine.books().vms[0].books.unmapped_pages, 0);
    let dom = r.engine.domain(DomainId(0));
    assert_eq!(dom.frames.in_use(), 0, "no frame held");
    for g in 0..6 {
        assert_eq!(r.agent.peek(Gfn(g)).unwrap()[..], page(7)[..]);
    }
}

#[test]
fn with_the_knob_off_cold_identical_pages_are_mapped() {
    let r = rig(false);
    for g in (0..6).chain(8..10) {
        assert!(
            matches!(state(&r, g), PageState::Shared(_)),
            "page {g} is {:?}",
            state(&r, g)
        );
    }
    assert_eq!(r.engine.books().vms[0].books.unmapped_shares, 0);
}

/// Read while shared without a mapping, a page comes back private (decoded against the
/// frame); taken back soon, it waits the re-store back-off, so the scan maps it
/// meanwhile — no page cycles through stash and decode.
#[test]
fn a_page_read_while_unmapped_comes_back_then_stays_mapped() {
    let mut r = rig(true);
    assert_eq!(r.agent.read(Gfn(0)).unwrap()[..], page(7)[..]);
    r.report();
    assert_eq!(state(&r, 0), PageState::Private);
    assert_eq!(r.engine.vms[&r.vm].hints.restash_wait(Gfn(0)), 2);
    // Read every 300 ms for 6 s: it must settle mapped.
    for _ in 0..20 {
        r.agent.read(Gfn(0)).unwrap();
        settle(&mut r, 300, &[]);
    }
    let v = r.engine.books().vms[0].books.clone();
    assert!(
        matches!(state(&r, 0), PageState::Shared(_)),
        "{:?}",
        state(&r, 0)
    );
    assert_eq!(v.unstashes, 1, "decoded back once: {v:#?}");
    assert_eq!(v.unmapped_shares, 6, "{v:#?}");
    for g in 0..6 {
        assert_eq!(r.agent.peek(Gfn(g)).unwrap()[..], page(7)[..]);
    }
}

/// A guest at its VMA budget is not asked for shares scan after scan: after a refusal
/// its identical pages are left private (or, with the knob on, shared without a
/// mapping) for [`VMA_PRESSURE_US`], so its agent sees a burst of requests per
/// window, not one per page per scan (a scan every 10 ms here: 192 000 in 120 s).
#[test]
fn an_agent_that_refuses_every_share_is_asked_in_one_burst_per_window() {
    for on in [false, true] {
        let mut r = Rig::new(cfg(on), PAGES).unwrap();
        for g in 0..PAGES {
            r.agent.write(Gfn(g), 0, &page(7)).unwrap();
        }
        r.agent.refuse = true;
        let all: Vec<u32> = (0..PAGES).collect();
        settle(&mut r, 120_000, &all);
        let refused = r.engine.vms[&r.vm].books.share_refused;
        assert!(refused > 0, "knob {on}: asked at all");
        assert!(
            refused <= 5 * PAGES as u64,
            "knob {on}: {refused} refusals in 120 s (4 windows of 30 s)"
        );
        for g in 0..PAGES {
            assert_eq!(r.agent.peek(Gfn(g)).unwrap()[..], page(7)[..]);
        }
    }
}

/// An agent that refuses shares (its VMA budget) gets its identical pages shared
/// without a mapping, hot ones too, for [`VMA_PRESSURE_US`].
#[test]
fn after_a_refused_share_hot_identical_pages_are_shared_without_a_mapping() {
    let mut r = Rig::new(cfg(true), PAGES).unwrap();
    for g in 0..PAGES {
        r.agent.write(Gfn(g), 0, &page(100 + g)).unwrap();
    }
    settle(&mut r, 1000, &[]);
    for g in 0..4 {
        r.agent.write(Gfn(g), 0, &page(7)).unwrap();
    }
    // The first shares are refused.
    r.agent.refuse = true;
    let mut steps = 0;
    while r.engine.vms[&r.vm].books.share_refused == 0 {
        for g in 0..4 {
            r.agent.read(Gfn(g)).unwrap();
        }
        r.step(10_000).unwrap();
        steps += 1;
        assert!(steps < 200, "no share was refused");
    }
    r.agent.refuse = false;
    assert!(r.engine.vma_pressure(r.vm));
    settle(&mut r, 1000, &[0, 1, 2, 3]);
    let v = r.engine.books().vms[0].books.clone();
    assert_eq!(v.unmapped_shares, 4, "{v:#?}");
    // Read all the time, they came back private at once, and their back-off keeps
    // them from being stored again: they are mapped (a real agent out of VMAs would
    // refuse, and they would stay private) — no cycle of stash and decode.
    assert_eq!(v.unstashes, 4, "{v:#?}");
    settle(&mut r, 2000, &[0, 1, 2, 3]);
    let w = &r.engine.books().vms[0].books;
    assert_eq!((w.unmapped_shares, w.unstashes), (4, 4), "{w:#?}");
    for g in 0..4 {
        assert_eq!(r.agent.peek(Gfn(g)).unwrap()[..], page(7)[..]);
    }
    // Pressure ends 30 s after the refusal.
    r.clock.advance(VMA_PRESSURE_US);
    assert!(!r.engine.vma_pressure(r.vm));
}

/// Under VMA pressure the clock turns mapped shared pages into shares without a
/// mapping (issue 19: the pages mapped first must not hold the budget for good);
/// pages read while shared come back private on their first read and end mapped
/// once the pressure is over.
#[test]
fn under_vma_pressure_mapped_shares_become_unmapped_and_read_ones_end_mapped() {
    let mut r = with_twins(true, 8);
    let hot: Vec<u32> = (0..8).collect();
    settle(&mut r, 1500, &hot);
    let PageState::Shared(f) = state(&r, 0) else {
        panic!("page 0 is {:?}", state(&r, 0));
    };
    for g in 0..8 {
        assert_eq!(state(&r, g), PageState::Shared(f), "page {g}");
    }
    press(&mut r);
    // Pages 6–7 are read all the time, 0–5 never again.
    settle(&mut r, 3000, &[6, 7]);
    let v = r.engine.books().vms[0].books.clone();
    for g in 0..6 {
        assert_eq!(
            state(&r, g),
            PageState::Unmapped(f),
            "cold page {g}, against the frame it was mapped onto: {v:#?}"
        );
    }
    assert!(v.unmaps >= 8, "all eight asked back and unmapped: {v:#?}");
    assert_eq!(
        v.cow_breaks, 0,
        "memfoldd's own breaks are no CoW breaks: {v:#?}"
    );
    // Pressure over (30 s from the refusal), the read pages are mapped again.
    settle(&mut r, VMA_PRESSURE_US / 1000 + 3000, &[6, 7]);
    for g in 6..8 {
        assert!(
            matches!(state(&r, g), PageState::Shared(_)),
            "read page {g} is {:?}",
            state(&r, g)
        );
    }
    for g in 0..6 {
        assert!(matches!(state(&r, g), PageState::Unmapped(_)), "page {g}");
    }
    for g in 0..PAGES {
        assert_eq!(
            r.agent.peek(Gfn(g)).unwrap()[..],
            page(seed(g, 8))[..],
            "page {g}"
        );
    }
}

/// A page asked back to be unmapped whose guest discarded it instead (a balloon) is
/// no longer being unmapped: once shared again, the guest's write is a CoW break, not
/// a break memfoldd asked for. Fails without `take_shared` dropping it from
/// `unmapping`: the take-back's answer kept it there (the books still said shared),
/// and the later write was taken for memfoldd's own break and unmapped.
#[test]
fn a_page_discarded_while_being_unmapped_is_not_unmapped_at_its_next_break() {
    let mut r = with_twins(true, 8);
    let hot: Vec<u32> = (0..8).collect();
    settle(&mut r, 1500, &hot);
    assert!((0..8).all(|g| matches!(state(&r, g), PageState::Shared(_))));
    press(&mut r);
    let take_back = |c: &Command| match *c {
        Command::TakeBack { gfn } => Some(gfn),
        _ => None,
    };
    let mut asked = None;
    for _ in 0..300 {
        r.clock.advance(10_000);
        r.engine.scan_step().unwrap();
        r.engine.clock_step();
        let cmds = r.engine.take_commands(r.vm);
        asked = cmds.iter().find_map(take_back);
        if let Some(g) = asked {
            // The balloon takes the page before the agent sees the take-back.
            r.agent.discard(g);
        }
        for c in cmds {
            r.answer(c);
        }
        r.report();
        if asked.is_some() {
            break;
        }
    }
    let g = asked.expect("a page asked back under pressure");
    assert_eq!(r.engine.vms[&r.vm].state(g), PageState::Private);
    assert!(
        !r.engine.vms[&r.vm].unmapping.contains(&g),
        "{g} discarded, still being unmapped"
    );
    // Pressure over: written back and read, it is mapped again; then written.
    r.engine.vms.get_mut(&r.vm).unwrap().share_refused_us = None;
    r.agent.write(g, 0, &page(7)).unwrap();
    settle(&mut r, 1500, &[g.0]);
    assert!(matches!(r.engine.vms[&r.vm].state(g), PageState::Shared(_)));
    let before = r.engine.vms[&r.vm].books.clone();
    r.agent.write(g, 0, &page(60)).unwrap();
    r.report();
    let after = &r.engine.vms[&r.vm].books;
    assert_eq!(
        (after.cow_breaks, after.unmaps),
        (before.cow_breaks + 1, before.unmaps),
        "the guest's write is a CoW break"
    );
    assert_eq!(r.engine.vms[&r.vm].state(g), PageState::Private);
    r.engine.check_invariants().unwrap();
}

/// A frame's last mapped page turned into a share without a mapping keeps the frame:
/// the page's blob decodes against it.
#[test]
fn a_frame_whose_last_mapping_goes_unmapped_stays_held() {
    let mut r = with_twins(true, 2);
    settle(&mut r, 1500, &[0, 1]);
    let PageState::Shared(f) = state(&r, 0) else {
        panic!("page 0 is {:?}", state(&r, 0));
    };
    r.agent.write(Gfn(1), 0, &page(50)).unwrap();
    r.report();
    assert_eq!(r.engine.domain(DomainId(0)).frames.refcount(f), 1);
    press(&mut r);
    settle(&mut r, 3000, &[]);
    assert_eq!(state(&r, 0), PageState::Unmapped(f));
    let dom = r.engine.domain(DomainId(0));
    assert_eq!((dom.frames.refcount(f), dom.frames.patch_refs(f)), (1, 1));
    assert_eq!(r.agent.read(Gfn(0)).unwrap()[..], page(7)[..]);
    assert_eq!(r.agent.peek(Gfn(1)).unwrap()[..], page(50)[..]);
}

/// With the knob off, VMA pressure leaves mapped pages mapped.
#[test]
fn with_the_knob_off_mapped_shares_stay_mapped_under_pressure() {
    let mut r = with_twins(false, 8);
    settle(&mut r, 1500, &[]);
    press(&mut r);
    settle(&mut r, 3000, &[]);
    for g in 0..8 {
        assert!(matches!(state(&r, g), PageState::Shared(_)), "page {g}");
    }
    assert_eq!(r.engine.books().vms[0].books.unmaps, 0);
}

/// With the knob off, a disk read under VMA pressure that finds its twin in a hinted
/// page leaves that page alone: deferred like the read page, not shared without a
/// mapping (the scan's partner was turned from Defer to Unmapped whatever made it
/// Defer: the knob, a zero page, the re-store wait).
#[test]
fn with_the_knob_off_a_read_under_pressure_never_unmaps_its_hinted_twin() {
    let mut r = with_twins(false, 0);
    settle(&mut r, 1500, &[]);
    r.agent.write(Gfn(2), 0, &page(77)).unwrap();
    r.engine.read_landed(r.vm, &[Gfn(2)], 0);
    press(&mut r);
    r.agent.write(Gfn(10), 0, &page(77)).unwrap();
    r.engine.read_landed(r.vm, &[Gfn(10)], 0);
    assert_eq!(state(&r, 2), PageState::Private, "the hinted twin");
    r.carry_out();
    assert_eq!(r.engine.books().vms[0].books.unmapped_shares, 0);
    r.engine.check_invariants().unwrap();
}

#[test]
fn the_identical_patch_decodes_to_the_reference() {
    let reference: Box<Page> = page(3).try_into().unwrap();
    let mut out = [0u8; PAGE_SIZE];
    PatchCodec::RunDiff
        .decode(&reference, &IDENTICAL_PATCH, &mut out)
        .unwrap();
    assert_eq!(out[..], reference[..]);
}
