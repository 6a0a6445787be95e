//! Never-share (Satori §4.3): marked pages and their partners taken back.

use crate::categories::CategoryRun;
use crate::ids::Gfn;
use crate::p2m::PageState;
use crate::share::ShareEntry;
use crate::sim::Rig;
use crate::{EngineConfig, Policy, PAGE_SIZE};

const PAGES: u32 = 256;

fn cfg(policy: Policy) -> EngineConfig {
    EngineConfig {
        policy,
        rate: 0,
        clock_interval_us: None,
        min_scan_interval_us: 10_000,
        max_scan_interval_us: 10_000,
        quiet_scan_period: 1,
        ..EngineConfig::default()
    }
}

/// Bytes of `seed`, never zero.
fn content(seed: u32) -> Vec<u8> {
    let mut p: Vec<u8> = (0..PAGE_SIZE)
        .map(|i| (i * 7 + (i >> 9)) as u8 | 1)
        .collect();
    p[..4].copy_from_slice(&seed.to_le_bytes());
    p
}

/// A report of every page as anonymous, `marked` ones never-share.
fn report(marked: &[u32]) -> Vec<CategoryRun> {
    crate::sim::anon_report(PAGES, marked)
}

/// Pages 0..64 hold 16 contents four times each (groups of four equal pages); the
/// rest are unique.
fn rig(policy: Policy) -> Rig {
    let mut r = Rig::new(cfg(policy), PAGES).unwrap();
    for g in 0..PAGES {
        let seed = if g < 64 { g / 4 } else { 1000 + g };
        r.agent.write(Gfn(g), 0, &content(seed)).unwrap();
    }
    r
}

fn settle(r: &mut Rig) {
    for _ in 0..6 {
        r.step(10_000).unwrap();
    }
    r.engine.check_invariants().unwrap();
}

fn state(r: &Rig, g: u32) -> PageState {
    r.engine.vms[&r.vm].state(Gfn(g))
}

fn shared(r: &Rig, g: u32) -> bool {
    matches!(state(r, g), PageState::Shared(_))
}

/// Marked just before its agent's connection dropped: the take-backs queued then end
/// with the connection, and the re-attach asks again.
/// Fails without the re-ask in `attach`: page 0 stays on the frame it shares.
#[test]
fn a_page_marked_as_its_agent_detached_is_taken_back_after_the_reattach() {
    let mut r = rig(Policy::sharing_only());
    r.engine.guest_categories(r.vm, &report(&[])).unwrap();
    settle(&mut r);
    assert!(shared(&r, 0), "{:?}", state(&r, 0));
    r.engine.guest_categories(r.vm, &report(&[0])).unwrap();
    r.engine.detach(r.vm);
    r.vm = r.reattach().unwrap();
    settle(&mut r);
    assert_eq!(
        state(&r, 0),
        PageState::Private,
        "marked page after re-attach"
    );
    assert_eq!(r.agent.peek(Gfn(0)).unwrap().to_vec(), content(0));
}

/// Marked before the scan: a marked page is never shared (and leaves no hint that its
/// twins could pair with), its unmarked twins still are.
#[test]
fn a_marked_page_is_never_shared_and_its_twins_still_are() {
    let mut r = rig(Policy::sharing_only());
    // Group 0: one page of four marked. Group 1: three of four. Group 2: all four.
    let marked = [0, 4, 5, 6, 8, 9, 10, 11];
    r.engine.guest_categories(r.vm, &report(&marked)).unwrap();
    settle(&mut r);
    for g in marked {
        assert_eq!(state(&r, g), PageState::Private, "marked page {g}");
    }
    assert!((1..4).all(|g| shared(&r, g)), "group 0's unmarked pages");
    assert!(!shared(&r, 7), "group 1's only unmarked page has no twin");
    assert!((12..64).all(|g| shared(&r, g)), "unmarked groups");
    // Every byte as written.
    for g in 0..PAGES {
        let seed = if g < 64 { g / 4 } else { 1000 + g };
        assert_eq!(r.agent.peek(Gfn(g)).unwrap().to_vec(), content(seed));
    }
}

/// Marked after it was shared: the next report takes it back into guest RAM, and its
/// partners on the frame too (alone on it, their writes would still be CoW breaks);
/// the frame leaves the share table; the scan does not share the marked page again,
/// while its partners pair again without it.
#[test]
fn a_page_marked_after_its_share_is_taken_back_with_its_partners() {
    let mut r = rig(Policy::sharing_only());
    r.engine.guest_categories(r.vm, &report(&[])).unwrap();
    settle(&mut r);
    let PageState::Shared(f) = state(&r, 0) else {
        panic!("page 0 shared first: {:?}", state(&r, 0));
    };
    assert!((1..4).all(|g| state(&r, g) == PageState::Shared(f)));
    r.engine.guest_categories(r.vm, &report(&[0])).unwrap();
    let queued: Vec<Gfn> = r.engine.vms[&r.vm]
        .queue
        .iter()
        .filter_map(|c| match *c {
            crate::engine::Command::TakeBack { gfn } => Some(gfn),
            _ => None,
        })
        .collect();
    assert_eq!(
        queued,
        (0..4).map(Gfn).collect::<Vec<_>>(),
        "the page and its partners"
    );
    assert_eq!(r.engine.vms[&r.vm].books.never_share_takebacks, 4);
    let d = r.engine.vms[&r.vm].domain;
    let dom = r.engine.domain(d);
    assert!(
        !dom.share
            .lookup(dom.frames.hash(f))
            .any(|e| e == ShareEntry::Shared(f)),
        "the frame left the share table"
    );
    settle(&mut r);
    assert_eq!(
        state(&r, 0),
        PageState::Private,
        "taken back, not shared again"
    );
    assert_eq!(r.agent.peek(Gfn(0)).unwrap().to_vec(), content(0));
    let PageState::Shared(f2) = state(&r, 1) else {
        panic!("partners pair again: {:?}", state(&r, 1));
    };
    assert!((2..4).all(|g| state(&r, g) == PageState::Shared(f2)));
    // Unmarked again: it may share again.
    r.engine.guest_categories(r.vm, &report(&[])).unwrap();
    settle(&mut r);
    assert!(shared(&r, 0), "unmarked, shared again");
}

/// Marked while its share was under way (the report found no frame to withdraw):
/// when the share lands, the page is taken back and its frame withdrawn at once, as
/// the report would have; its partners, whose shares were under way too when the
/// pass went by, come back as they land. Fails without `Engine::never_share_landed`:
/// page 0 left shared on a frame still in the share table (other pages keep joining
/// it; the guest's write is a timable CoW break) until the guest's next report.
#[test]
fn a_page_marked_while_its_share_is_under_way_is_taken_back_when_it_lands() {
    use crate::engine::Command;
    let mut r = rig(Policy::sharing_only());
    r.engine.guest_categories(r.vm, &report(&[])).unwrap();
    let share_0 = |c: &Command| matches!(c, Command::Share { gfn: Gfn(0), .. });
    for _ in 0..20 {
        if r.engine.vms[&r.vm].queue.iter().any(share_0) {
            break;
        }
        r.clock.advance(10_000);
        r.engine.scan_step().unwrap();
    }
    let held = r.engine.take_commands(r.vm);
    let Some(&Command::Share { frame: f, .. }) = held.iter().find(|c| share_0(c)) else {
        panic!("no share of page 0 queued: {held:?}");
    };
    let onto_f: Vec<Gfn> = (held.iter())
        .filter_map(|c| match *c {
            Command::Share { gfn, frame } if frame == f => Some(gfn),
            _ => None,
        })
        .collect();
    r.engine.guest_categories(r.vm, &report(&[0])).unwrap();
    assert!(
        r.engine.vms[&r.vm].queue.is_empty(),
        "nothing on a frame yet"
    );
    for c in &held {
        let o = r.agent.execute(c);
        r.engine.outcome(r.vm, c, o);
    }
    r.report();
    let queued: Vec<Gfn> = (r.engine.vms[&r.vm].queue.iter())
        .filter_map(|c| match *c {
            Command::TakeBack { gfn } => Some(gfn),
            _ => None,
        })
        .collect();
    let d = r.engine.vms[&r.vm].domain;
    let dom = r.engine.domain(d);
    let listed = (dom.share.lookup(dom.frames.hash(f))).any(|e| e == ShareEntry::Shared(f));
    assert!(
        queued.contains(&Gfn(0)) && r.engine.withdrawn(d, f) && !listed,
        "page 0 {:?}, take-backs {queued:?}, {f} withdrawn {}, in the share table {listed}",
        state(&r, 0),
        r.engine.withdrawn(d, f)
    );
    assert!(
        onto_f.iter().all(|g| queued.contains(g)),
        "partners that landed on it: {onto_f:?}, taken back {queued:?}"
    );
    assert_eq!(
        r.engine.vms[&r.vm].books.never_share_takebacks,
        onto_f.len() as u64
    );
    settle(&mut r);
    assert_eq!(state(&r, 0), PageState::Private);
    assert!((0..4).all(|g| state(&r, g) != PageState::Shared(f)));
    assert!((1..4).all(|g| shared(&r, g)), "partners pair again");
    assert_eq!(r.agent.peek(Gfn(0)).unwrap().to_vec(), content(0));
}

/// As above for a patch (DE §3.2): a page marked while its stash against a reference
/// frame was under way is taken back when it lands, and the frame withdrawn (the
/// reference page shared onto it with the patch is taken back too). Fails without
/// `Engine::never_share_landed`: the page left stored against the frame.
#[test]
fn a_page_marked_while_its_patch_is_under_way_is_taken_back_when_it_lands() {
    use crate::engine::Command;
    let (mut r, held, g, f) = patch_under_way();
    r.engine.guest_categories(r.vm, &report(&[g.0])).unwrap();
    for c in &held {
        let o = r.agent.execute(c);
        r.engine.outcome(r.vm, c, o);
    }
    r.report();
    let d = r.engine.vms[&r.vm].domain;
    let queued = r.engine.vms[&r.vm].queued_take_backs();
    assert!(
        queued.contains(&g) && r.engine.withdrawn(d, f),
        "page {g} {:?}, take-backs {queued:?}, {f} withdrawn {}",
        r.engine.vms[&r.vm].state(g),
        r.engine.withdrawn(d, f)
    );
    let reference: Vec<Gfn> = (held.iter())
        .filter_map(|c| match *c {
            Command::Share { gfn, frame } if frame == f => Some(gfn),
            _ => None,
        })
        .collect();
    assert!(
        reference.iter().all(|h| queued.contains(h)),
        "reference page {reference:?} shared onto {f}, take-backs {queued:?}"
    );
    for _ in 0..10 {
        r.step(10_000).unwrap();
    }
    r.engine.check_invariants().unwrap();
    assert_eq!(r.engine.vms[&r.vm].state(g), PageState::Private);
    for k in 0..8 {
        assert_eq!(r.agent.peek(Gfn(k)).unwrap().to_vec(), near(k));
    }
}

/// A guest that toggles its marks cannot make memfoldd copy its partners back at
/// every report: after one pass, the next waits [`super::PARTNER_PASS_US`]; its own
/// marked page is taken back at every report.
#[test]
fn partner_take_backs_are_bounded_in_time() {
    let mut r = rig(Policy::sharing_only());
    r.engine.guest_categories(r.vm, &report(&[])).unwrap();
    settle(&mut r);
    r.engine.guest_categories(r.vm, &report(&[0])).unwrap();
    settle(&mut r);
    let books = |r: &Rig| r.engine.vms[&r.vm].books.never_share_takebacks;
    assert_eq!(books(&r), 4);
    // Unmarked: shared again with its partners (on their new frame); marked again at
    // once: only its own page comes back.
    r.engine.guest_categories(r.vm, &report(&[])).unwrap();
    settle(&mut r);
    assert!((0..4).all(|g| shared(&r, g)));
    r.engine.guest_categories(r.vm, &report(&[0])).unwrap();
    settle(&mut r);
    assert_eq!(books(&r), 5, "its own page only");
    assert_eq!(state(&r, 0), PageState::Private);
    assert!(
        (1..4).all(|g| shared(&r, g)),
        "partners wait for the next pass"
    );
    // A pass later, the partners on the withdrawn frame come back too.
    r.step(super::PARTNER_PASS_US).unwrap();
    r.engine.guest_categories(r.vm, &report(&[0])).unwrap();
    let queued = r.engine.vms[&r.vm]
        .queue
        .iter()
        .filter(|c| matches!(c, crate::engine::Command::TakeBack { .. }))
        .count();
    assert_eq!((books(&r), queued), (8, 3));
    settle(&mut r);
    r.engine.check_invariants().unwrap();
    for g in 0..64 {
        let seed = g / 4;
        assert_eq!(r.agent.peek(Gfn(g)).unwrap().to_vec(), content(seed));
    }
}

/// The pass over a domain's guests is the domain's, not each reporting guest's: right
/// after a marking guest's report took back as many partners as a pass may, another
/// guest's report takes back none (one timer a guest let every guest's report walk
/// every guest's pages; seen failing so, its report taking back the rest).
#[test]
fn the_partner_pass_is_the_domains_whichever_guest_reports() {
    use crate::backing::mem::{MemBacking, MemGuestRam};
    use crate::engine::Attach;
    use crate::ids::DomainId;
    use crate::sim::SimAgent;
    const B_PAGES: u32 = super::MAX_PARTNER_TAKEBACKS as u32 + 900;
    let mut r = rig(Policy::sharing_only());
    let ram = MemGuestRam::new(B_PAGES);
    let vm_b = r
        .engine
        .attach(Attach {
            name: "b".into(),
            pid: 2,
            pages: B_PAGES,
            ram: Box::new(ram.clone()),
            mapped: Vec::new(),
            domain: DomainId(0),
            store: Box::new(MemBacking::new()),
            swap: None,
            sharing: Default::default(),
        })
        .unwrap();
    let mut b = SimAgent::new(ram, B_PAGES, r.agent.shared.clone());
    for g in 0..B_PAGES {
        b.write(Gfn(g), 0, &content(0)).unwrap();
    }
    let carry_out_b = |r: &mut Rig, b: &mut SimAgent| {
        for c in r.engine.take_commands(vm_b) {
            if let Some((first, n, rb, mb)) = b.clock_scan_cmd(&c) {
                r.engine.clock_bits(vm_b, first, n, &rb, &mb);
            } else {
                let o = b.execute(&c);
                r.engine.outcome(vm_b, &c, o);
            }
        }
        for e in std::mem::take(&mut b.events) {
            if let crate::sim::Event::CowBroken(g, f) = e {
                r.engine.cow_broken(vm_b, g, f);
            }
        }
    };
    for _ in 0..8 {
        r.step(10_000).unwrap();
        carry_out_b(&mut r, &mut b);
    }
    let on_frame = |r: &Rig| {
        (0..B_PAGES)
            .filter(|&g| matches!(r.engine.vms[&vm_b].state(Gfn(g)), PageState::Shared(_)))
            .count()
    };
    assert_eq!(
        on_frame(&r),
        B_PAGES as usize,
        "b's pages shared with a's group 0"
    );
    // a's pass takes back as many as a pass may (a's three partners of its marked
    // page among them); the rest of b's wait on the withdrawn frame for the next pass.
    r.engine.guest_categories(r.vm, &report(&[0])).unwrap();
    r.carry_out();
    carry_out_b(&mut r, &mut b);
    let left = B_PAGES as usize - (super::MAX_PARTNER_TAKEBACKS - 3);
    assert_eq!(on_frame(&r), left);
    let b_report = crate::sim::anon_report(B_PAGES, &[]);
    r.engine.guest_categories(vm_b, &b_report).unwrap();
    assert_eq!(
        r.engine.vms[&vm_b].books.never_share_takebacks, 0,
        "b's report took back pages within a pass's time"
    );
    assert!(r.engine.vms[&vm_b].queue.is_empty());
    // A pass's time later, the rest come back too.
    r.clock.advance(super::PARTNER_PASS_US);
    r.engine.guest_categories(vm_b, &b_report).unwrap();
    carry_out_b(&mut r, &mut b);
    assert_eq!(on_frame(&r), 0);
    r.engine.check_invariants().unwrap();
    // b's report just ran the domain's pass; a's new mark withdraws a frame, so its
    // partners come back at once all the same (a new mark's partners left on it for
    // up to a pass's time would keep the side channel open that long).
    r.carry_out();
    assert!((5..8).all(|g| shared(&r, g)), "group 1 shared");
    r.engine.guest_categories(r.vm, &report(&[0, 4])).unwrap();
    let taken: Vec<u32> = (r.engine.vms[&r.vm].queue.iter())
        .filter_map(|c| match *c {
            crate::engine::Command::TakeBack { gfn } => Some(gfn.0),
            _ => None,
        })
        .collect();
    assert!((4..8).all(|g| taken.contains(&g)), "taken back: {taken:?}");
}

/// Bytes of `seed` that do not compress (xorshift).
/// A Difference Engine rig with a 100 ms clock: pages 0..8 are `near(k)` (near-copies
/// of one page, none compressing), the rest unique.
fn de_rig(near: impl Fn(u32) -> Vec<u8>) -> Rig {
    let mut r = Rig::new(
        EngineConfig {
            clock_interval_us: Some(100_000),
            ..cfg(Policy::difference_engine())
        },
        PAGES,
    )
    .unwrap();
    for g in 0..PAGES {
        let p = if g < 8 { near(g) } else { random(5000 + g) };
        r.agent.write(Gfn(g), 0, &p).unwrap();
    }
    r
}

fn random(seed: u32) -> Vec<u8> {
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

/// The Difference Engine neither patches a marked page nor patches against it; a
/// patched page marked later is taken back.
#[test]
fn a_marked_page_is_neither_patched_nor_a_reference() {
    let near = |k: u32| {
        let mut p = random(7);
        p[2000] = k as u8;
        p[100] = k as u8;
        p
    };
    let mut r = de_rig(near);
    r.engine
        .guest_categories(r.vm, &report(&[0, 1, 2, 3]))
        .unwrap();
    for _ in 0..300 {
        r.step(10_000).unwrap();
    }
    r.engine.check_invariants().unwrap();
    let patched_against = |r: &Rig, g: u32| match state(r, g) {
        PageState::Stored(b) => r.engine.blobs.get(b).reference(),
        PageState::Unmapped(f) => Some(f),
        _ => None,
    };
    for g in 0..4 {
        assert!(
            patched_against(&r, g).is_none() && !shared(&r, g),
            "marked page {g}: {:?}",
            state(&r, g)
        );
    }
    let patched: Vec<u32> = (4..8)
        .filter(|&g| patched_against(&r, g).is_some())
        .collect();
    assert!(!patched.is_empty(), "unmarked near-copies are patched");
    // Their reference frames hold an unmarked page's bytes, never a marked one's.
    let d = r.engine.vms[&r.vm].domain;
    for &g in &patched {
        let f = patched_against(&r, g).unwrap();
        let mut frame = [0u8; PAGE_SIZE];
        r.engine.domains[&d]
            .pool
            .read(f.offset(), &mut frame)
            .unwrap();
        assert!((0..4).all(|m| frame[..] != near(m)[..]), "reference of {g}");
    }
    // Marked later: taken back, every byte intact.
    r.engine.guest_categories(r.vm, &report(&patched)).unwrap();
    // The marked pages, and the pages on their reference frames (the reference page
    // itself, other patches against it).
    assert!(r.engine.vms[&r.vm].books.never_share_takebacks > patched.len() as u64);
    for _ in 0..10 {
        r.step(10_000).unwrap();
    }
    r.engine.check_invariants().unwrap();
    for &g in &patched {
        assert!(patched_against(&r, g).is_none(), "page {g} taken back");
    }
    for g in 0..8 {
        assert_eq!(r.agent.peek(Gfn(g)).unwrap().to_vec(), near(g));
    }
}

/// A page marked while its patch against a reference frame is under way, whose answer is
/// then lost (the connection dropped): the report withdraws the frame at once and takes
/// back the pages on it, for a lost answer never lands (`never_share_landed` never runs)
/// and the re-attach makes the page private; the re-attach asks again for the take-backs
/// that ended with the connection. Fails without `Stashing` in `sharing_frame` (the
/// frame stays in the share table with the reference page on it, whose next write is a
/// CoW break that says the marked page's bytes were there), and without
/// `retake_own_partners` (the reference page stays on the frame until the domain's next
/// pass, up to 10 s later).
#[test]
fn a_page_marked_while_its_patch_is_under_way_and_lost_has_its_frame_withdrawn() {
    use crate::engine::Outcome;
    let (mut r, held, g, f) = patch_under_way();
    // The reference page lands on f; the patch's answer is lost.
    for c in &held {
        if patch_of(c).is_some_and(|(h, _)| h == g) {
            continue;
        }
        let o = r.agent.execute(c);
        r.engine.outcome(r.vm, c, o);
    }
    r.report();
    let d = r.engine.vms[&r.vm].domain;
    let on_f: Vec<Gfn> = (0..PAGES)
        .map(Gfn)
        .filter(|&h| r.engine.vms[&r.vm].state(h) == PageState::Shared(f))
        .collect();
    assert!(!on_f.is_empty(), "the reference page is on {f}");
    r.engine.guest_categories(r.vm, &report(&[g.0])).unwrap();
    assert!(r.engine.withdrawn(d, f), "{f} withdrawn at the report");
    let queued = r.engine.vms[&r.vm].queued_take_backs();
    assert!(
        on_f.iter().all(|h| queued.contains(h)),
        "pages on {f} {on_f:?}, take-backs {queued:?}"
    );
    let stash = held
        .iter()
        .find(|c| patch_of(c).is_some_and(|(h, _)| h == g));
    r.engine.outcome(r.vm, stash.unwrap(), Outcome::Lost);
    r.engine.detach(r.vm);
    r.vm = r.reattach().unwrap();
    for _ in 0..10 {
        r.step(10_000).unwrap();
    }
    r.engine.check_invariants().unwrap();
    for h in 0..PAGES {
        assert_ne!(
            r.engine.vms[&r.vm].state(Gfn(h)),
            PageState::Shared(f),
            "page {h} still on {f}"
        );
    }
    for k in 0..8 {
        assert_eq!(r.agent.peek(Gfn(k)).unwrap().to_vec(), near(k));
    }
}

/// A DE rig of [`near`] pages with the commands of the first round that asks for a patch
/// (page `g` against reference frame `f`) held unanswered (earlier rounds answered).
fn patch_under_way() -> (Rig, Vec<crate::engine::Command>, Gfn, crate::ids::FrameId) {
    let mut r = de_rig(near);
    r.engine.guest_categories(r.vm, &report(&[])).unwrap();
    let mut held = Vec::new();
    for _ in 0..300 {
        r.clock.advance(10_000);
        r.engine.scan_step().unwrap();
        r.engine.clock_step();
        let cmds = r.engine.take_commands(r.vm);
        if cmds.iter().any(|c| patch_of(c).is_some()) {
            held = cmds;
            break;
        }
        for c in cmds {
            r.answer(c);
        }
        r.report();
    }
    let Some((g, f)) = held.iter().find_map(patch_of) else {
        panic!("no patch queued");
    };
    (r, held, g, f)
}

/// The page and reference frame of a patch request.
fn patch_of(c: &crate::engine::Command) -> Option<(Gfn, crate::ids::FrameId)> {
    match *c {
        crate::engine::Command::Stash { gfn, stash, .. } => stash.reference.map(|f| (gfn, f)),
        _ => None,
    }
}

/// Near-copies of one page that do not compress: page `k` of 0..8 of [`patch_under_way`].
fn near(k: u32) -> Vec<u8> {
    let mut p = random(7);
    p[2000] = k as u8;
    p
}
