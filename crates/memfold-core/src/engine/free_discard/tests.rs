//! The free-page discard's tests (split from free_discard.rs, which was over 800 lines).
use super::MAX_DATA_ASKS;
use crate::categories::{Category, CategoryRun, PageInfo};
use crate::engine::{Command, Outcome};
use crate::ids::Gfn;
use crate::p2m::PageState;
use crate::sim::Rig;
use crate::{EngineConfig, Policy, PAGE_SIZE};

const PAGES: u32 = 64;

/// Sharing alone, no clock, no scan rate limit, free pages discarded.
fn cfg() -> EngineConfig {
    EngineConfig {
        policy: Policy::sharing_only(),
        clock_interval_us: None,
        rate: 0,
        discard_free: true,
        ..EngineConfig::default()
    }
}

fn rig() -> Rig {
    Rig::new(cfg(), PAGES).unwrap()
}

/// A report: pages `free` free, the rest anonymous.
fn report(r: &mut Rig, free: &[u32]) {
    let runs = sample(free);
    r.engine.guest_categories(r.vm, &runs).unwrap();
}

/// A report's runs as the guest samples them: pages `free` free, the rest anonymous.
fn sample(free: &[u32]) -> Vec<CategoryRun> {
    runs_of(PAGES, |g| free.contains(&g))
}

/// A report of a guest of `pages` pages, a run a page: those `free` says free (in the
/// buddy allocator), the rest anonymous.
fn runs_of(pages: u32, free: impl Fn(u32) -> bool) -> Vec<CategoryRun> {
    (0..pages)
        .map(|g| CategoryRun {
            first: Gfn(g),
            count: 1,
            info: PageInfo {
                category: if free(g) {
                    Category::Free
                } else {
                    Category::Anon
                },
                active: false,
                referenced: false,
                buddy: free(g),
                never_share: false,
            },
        })
        .collect()
}

/// One watch round over the pages `free` (all private or held, with data): the report,
/// a watch of each, carried out; the round it armed.
fn armed_round(r: &mut Rig, free: &[u32]) -> super::WatchRound {
    report(r, free);
    assert_eq!(
        r.engine.discard_free(r.vm, None, true),
        free.len(),
        "watches"
    );
    r.carry_out();
    r.engine.watch_armed(r.vm).expect("armed")
}

/// Bytes of pages 0..4 in [`shared_rig`].
const DUP: [u8; PAGE_SIZE] = [0x5a; PAGE_SIZE];

/// Sharing alone, scanning fast, no clock: pages 0..4 hold [`DUP`] and are shared
/// onto one frame, the others unique.
fn shared_rig() -> Rig {
    let cfg = EngineConfig {
        policy: Policy::sharing_only(),
        clock_interval_us: None,
        rate: 1 << 20,
        min_scan_interval_us: 10_000,
        max_scan_interval_us: 10_000,
        quiet_scan_period: 1,
        discard_free: true,
        ..EngineConfig::default()
    };
    let mut r = Rig::new(cfg, PAGES).unwrap();
    for g in 0..PAGES {
        let b = if g < 4 { DUP } else { [g as u8 + 1; PAGE_SIZE] };
        r.agent.write(Gfn(g), 0, &b).unwrap();
    }
    for _ in 0..4 {
        r.step(20_000).unwrap();
    }
    for g in 0..4 {
        assert!(
            matches!(
                r.engine.page_state(r.vm, Gfn(g)),
                Some(PageState::Shared(_))
            ),
            "page {g}: {:?}",
            r.engine.page_state(r.vm, Gfn(g))
        );
    }
    r
}

#[test]
fn a_round_watches_then_discards_what_a_later_report_still_shows_free() {
    let mut r = rig();
    for g in 0..PAGES {
        r.agent.write(Gfn(g), 0, &[g as u8 + 1; 64]).unwrap();
    }
    report(&mut r, &[1, 2, 3, 4]);
    assert_eq!(r.engine.discard_free(r.vm, None, true), 4, "watches");
    assert_eq!(r.engine.watch_armed(r.vm), None, "not answered yet");
    r.carry_out();
    let round = r.engine.watch_armed(r.vm).expect("armed");
    // The guest writes page 2 (allocated again) and frees page 9 after the watch.
    r.agent.write(Gfn(2), 0, b"mine").unwrap();
    // A report from before the arming discards nothing.
    report(&mut r, &[1, 2, 3, 9]);
    assert_eq!(r.engine.discard_free(r.vm, None, true), 0);
    // One asked after: pages 1, 2 and 3 (4 is in use again; 9 was never watched).
    assert_eq!(r.engine.discard_free(r.vm, Some(round), true), 3);
    r.carry_out();
    let b = r.engine.books().vms[0].books.clone();
    assert_eq!(b.free_discards, 2, "page 2 was written since its watch");
    // Booked as free-page discard's saving, not the zero-page reclaim's.
    let by = r.engine.books().saved_by;
    assert_eq!((b.free_reclaimed_pages, by.free, by.zero), (2, 2, 0));
    assert_eq!(r.engine.page_state(r.vm, Gfn(1)), Some(PageState::Zero));
    assert_eq!(r.engine.page_state(r.vm, Gfn(2)), Some(PageState::Private));
    assert_eq!(&r.agent.read(Gfn(2)).unwrap()[..4], b"mine");
    assert_eq!(r.agent.read(Gfn(1)).unwrap(), [0u8; PAGE_SIZE]);
    // Touched again: no longer saved.
    r.report();
    let b = r.engine.books();
    assert_eq!(
        (b.vms[0].books.free_reclaimed_pages, b.saved_by.free),
        (1, 1)
    );
    assert_eq!(b.saved_pages, 1);
    r.engine.check_invariants().unwrap();
    // The round is over: the next report starts another.
    report(&mut r, &[5]);
    assert_eq!(r.engine.discard_free(r.vm, Some(round), true), 1);
    assert!(matches!(
        r.engine.take_commands(r.vm)[..],
        [Command::Watch { gfn: Gfn(5), .. }]
    ));
}

#[test]
fn an_answer_for_an_ended_round_counts_for_nothing() {
    let mut r = rig();
    for g in 0..8 {
        r.agent.write(Gfn(g), 0, b"data").unwrap();
    }
    report(&mut r, &[1]);
    r.engine.discard_free(r.vm, None, true);
    // Under way when the guest says not to discard: the round ends. Then it may
    // again: a new round.
    let old = r.engine.take_commands(r.vm);
    r.engine.discard_free(r.vm, None, false);
    report(&mut r, &[2, 3]);
    assert_eq!(r.engine.discard_free(r.vm, None, true), 2);
    let new = r.engine.take_commands(r.vm);
    r.engine.outcome(r.vm, &old[0], Outcome::Done);
    r.engine.outcome(r.vm, &new[0], Outcome::Done);
    assert_eq!(
        r.engine.watch_armed(r.vm),
        None,
        "armed by the old round's answer before page 3 is watched"
    );
    r.engine.outcome(r.vm, &new[1], Outcome::Done);
    let round = r.engine.watch_armed(r.vm).expect("armed");
    report(&mut r, &[1, 2, 3]);
    assert_eq!(
        r.engine.discard_free(r.vm, Some(round), true),
        2,
        "page 1 was watched in the ended round only"
    );
}

#[test]
fn a_lost_watch_ends_its_round_and_a_guest_that_poisons_pages_is_never_discarded() {
    let mut r = rig();
    for g in 0..4 {
        r.agent.write(Gfn(g), 0, b"data").unwrap();
    }
    // Page 40 was never written: a hole, never watched.
    report(&mut r, &[1, 2, 40]);
    assert_eq!(r.engine.discard_free(r.vm, None, true), 2);
    let cmds = r.engine.take_commands(r.vm);
    r.engine.outcome(r.vm, &cmds[0], Outcome::Done);
    r.engine.outcome(r.vm, &cmds[1], Outcome::Lost);
    assert_eq!(r.engine.watch_armed(r.vm), None);
    // Not discardable: nothing asked, ever.
    report(&mut r, &[1, 2]);
    assert_eq!(r.engine.discard_free(r.vm, None, false), 0);
    assert!(r.engine.take_commands(r.vm).is_empty());
}

/// Satori §4.3's no-copy-on-write, per page: shared pages the guest reports free are
/// watched (their share protects them) and, still free in a later report, dropped
/// from their frame to a hole — no copy, the frame loses a holder. One the guest
/// wrote after its watch (a CoW break) keeps its bytes; the page still sharing the
/// frame keeps reading it.
#[test]
fn shared_pages_reported_free_are_dropped_from_their_frame_without_a_copy() {
    let mut r = shared_rig();
    let dup = DUP;
    let shared_before = r.engine.books().vms[0].books.shared_pages;
    let round = armed_round(&mut r, &[0, 1, 2]);
    // The guest writes page 1 after its watch: a CoW break, its own bytes again.
    r.agent.write(Gfn(1), 0, b"mine").unwrap();
    r.report();
    report(&mut r, &[0, 1, 2]);
    // Page 1 is private now: discarded only if its watch held (it did not).
    assert_eq!(r.engine.discard_free(r.vm, Some(round), true), 3);
    r.carry_out();
    let b = r.engine.books().vms[0].books.clone();
    assert_eq!(
        (
            b.free_discards,
            b.free_discards_shared,
            b.free_discards_stored
        ),
        (2, 2, 0)
    );
    assert_eq!(b.cow_breaks, 1, "only the written page was copied");
    assert_eq!(b.shared_pages, shared_before - 3);
    assert_eq!(b.free_reclaimed_pages, 2);
    for g in [0, 2] {
        assert_eq!(r.engine.page_state(r.vm, Gfn(g)), Some(PageState::Zero));
        assert_eq!(r.agent.peek(Gfn(g)).unwrap(), [0u8; PAGE_SIZE], "page {g}");
    }
    let mut want1 = dup;
    want1[..4].copy_from_slice(b"mine");
    assert_eq!(r.agent.peek(Gfn(1)).unwrap(), want1);
    assert_eq!(r.agent.peek(Gfn(3)).unwrap(), dup, "still on the frame");
    r.engine.check_invariants().unwrap();
}

/// The race the agent's watch bit closes for a shared page: the guest's report is
/// sampled (page 0 free), then the guest allocates and writes page 0 — with bytes
/// that equal the frame, so the scan shares it again before the report arrives.
/// memfoldd sees a shared page its report calls free and asks to discard it; the
/// agent refuses (the CoW break ended the watch) and the guest's bytes stay.
#[test]
fn a_page_written_and_shared_again_after_the_sample_is_not_discarded() {
    let mut r = shared_rig();
    let dup = DUP;
    let round = armed_round(&mut r, &[0]);
    // The guest's report: sampled now, page 0 free...
    let sampled = sample(&[0]);
    // ...then page 0 allocated and written (a CoW break), and shared again.
    r.agent.write(Gfn(0), 0, &dup).unwrap();
    r.report();
    assert_eq!(r.engine.page_state(r.vm, Gfn(0)), Some(PageState::Private));
    for _ in 0..4 {
        r.step(20_000).unwrap();
    }
    assert!(matches!(
        r.engine.page_state(r.vm, Gfn(0)),
        Some(PageState::Shared(_))
    ));
    // The report arrives: memfoldd asks, the agent refuses.
    r.engine.guest_categories(r.vm, &sampled).unwrap();
    assert_eq!(r.engine.discard_free(r.vm, Some(round), true), 1);
    r.carry_out();
    assert_eq!(
        r.agent.peek(Gfn(0)).unwrap(),
        dup,
        "the guest's write is kept"
    );
    assert_eq!(r.engine.books().vms[0].books.free_discards, 0);
    assert!(matches!(
        r.engine.page_state(r.vm, Gfn(0)),
        Some(PageState::Shared(_))
    ));
    r.engine.check_invariants().unwrap();
}

/// Page `g`'s text: a line of its own, repeated (it compresses, and no two pages match).
fn text(g: u32) -> Vec<u8> {
    let line = format!("page {g}: a line of text that a guest keeps in a file. ");
    line.bytes().cycle().take(PAGE_SIZE).collect()
}

/// The Difference Engine with the free-page discard, over a guest of [`text`] pages.
fn text_rig() -> Rig {
    let cfg = EngineConfig {
        discard_free: true,
        ..crate::sim::quick_config(Policy::difference_engine())
    };
    let mut r = Rig::new(cfg, PAGES).unwrap();
    for g in 0..PAGES {
        r.agent.write(Gfn(g), 0, &text(g)).unwrap();
    }
    r
}

/// Stored pages the guest reports free are dropped from the store (their blobs
/// released) once a later report still shows them free; a page decoded by a read
/// after its watch is not (its bytes are back in RAM, and the watch ended).
#[test]
fn stored_pages_reported_free_release_their_blobs() {
    let mut r = text_rig();
    for _ in 0..50 {
        r.step(10_000).unwrap();
    }
    let stored: Vec<u32> = (0..PAGES)
        .filter(|&g| {
            matches!(
                r.engine.page_state(r.vm, Gfn(g)),
                Some(PageState::Stored(_))
            )
        })
        .collect();
    assert!(stored.len() >= 8, "stored: {stored:?}");
    let free: Vec<u32> = stored[..6].to_vec();
    let round = armed_round(&mut r, &free);
    // A read decodes the first one: a new home, its watch over.
    assert_eq!(r.agent.read(Gfn(free[0])).unwrap().to_vec(), text(free[0]));
    r.report();
    let kept_before = r.engine.books().vms[0].books.clone();
    report(&mut r, &free);
    r.engine.discard_free(r.vm, Some(round), true);
    r.carry_out();
    let b = r.engine.books().vms[0].books.clone();
    assert_eq!(
        (
            b.free_discards,
            b.free_discards_stored,
            b.free_discards_shared
        ),
        (5, 5, 0),
        "{b:#?}"
    );
    let kept = |b: &crate::engine::VmBooks| b.patched_pages + b.compressed_pages;
    assert_eq!(kept(&b) + 5, kept(&kept_before));
    assert_eq!(r.agent.peek(Gfn(free[0])).unwrap().to_vec(), text(free[0]));
    for &g in &free[1..] {
        assert_eq!(r.engine.page_state(r.vm, Gfn(g)), Some(PageState::Zero));
        assert_eq!(r.agent.peek(Gfn(g)).unwrap(), [0u8; PAGE_SIZE], "page {g}");
    }
    for &g in &stored[6..] {
        assert_eq!(r.agent.peek(Gfn(g)).unwrap().to_vec(), text(g), "page {g}");
    }
    r.engine.check_invariants().unwrap();
}

/// A private page its guest reports free is left to the free-page discard: the
/// Difference Engine stores the guest's other cold pages but not it (its bytes are
/// dead: a store would keep them, and decode them at the page's reuse), and the next
/// round discards it. A guest that may not be discarded (page poisoning) has its free
/// pages stored like any other.
#[test]
fn the_difference_engine_leaves_free_pages_to_the_discard() {
    let free: Vec<u32> = (0..PAGES / 2).collect();
    let stored = |r: &Rig, pages: std::ops::Range<u32>| {
        pages
            .filter(|&g| {
                matches!(
                    r.engine.page_state(r.vm, Gfn(g)),
                    Some(PageState::Stored(_))
                )
            })
            .count()
    };
    let cold = |discardable: bool| {
        let mut r = text_rig();
        report(&mut r, &free);
        r.engine.discard_free(r.vm, None, discardable);
        for _ in 0..50 {
            r.step(10_000).unwrap();
        }
        r.engine.check_invariants().unwrap();
        r
    };
    let mut r = cold(true);
    assert_eq!(stored(&r, 0..PAGES / 2), 0, "free pages are not stored");
    assert!(
        stored(&r, PAGES / 2..PAGES) >= PAGES as usize / 4,
        "the other cold pages are: {}",
        stored(&r, PAGES / 2..PAGES)
    );
    let round = r.engine.watch_armed(r.vm).expect("the free pages watched");
    report(&mut r, &free);
    assert_eq!(r.engine.discard_free(r.vm, Some(round), true), free.len());
    r.carry_out();
    assert_eq!(r.engine.books().saved_by.free, free.len() as i64);
    for g in 0..PAGES {
        let want = if g < PAGES / 2 {
            vec![0; PAGE_SIZE]
        } else {
            text(g)
        };
        assert_eq!(r.agent.peek(Gfn(g)).unwrap().to_vec(), want, "page {g}");
    }
    r.engine.check_invariants().unwrap();

    let poisoning = cold(false);
    assert!(
        stored(&poisoning, 0..PAGES / 2) >= PAGES as usize / 4,
        "a guest that may not be discarded has its free pages stored: {}",
        stored(&poisoning, 0..PAGES / 2)
    );
}

/// A guest whose RAM is a sieve (data on every other page) costs memfoldd no walk of
/// its data runs for a report with nothing free, and at most [`MAX_DATA_ASKS`] asks a
/// round for one with every data page free, the next round going on from where it
/// stopped. Seen failing with the walk over every data run (32 769 asks for the
/// empty report).
#[test]
fn a_round_asks_guest_ram_where_its_data_is_within_a_budget() {
    const SIEVE: u32 = 1 << 16;
    let mut r = Rig::new(cfg(), SIEVE).unwrap();
    for g in (0..SIEVE).step_by(2) {
        r.agent.write(Gfn(g), 0, b"data").unwrap();
    }
    let asks = |r: &Rig| r.agent.ram.file().data_asks;
    let before = asks(&r);
    r.engine
        .guest_categories(r.vm, &runs_of(SIEVE, |_| false))
        .unwrap();
    assert_eq!(r.engine.discard_free(r.vm, None, true), 0);
    assert_eq!(
        asks(&r) - before,
        0,
        "asked where data is with nothing free"
    );
    // Every data page free: a run each, one ask each, up to the budget.
    let before = asks(&r);
    r.engine
        .guest_categories(r.vm, &runs_of(SIEVE, |g| g % 2 == 0))
        .unwrap();
    let first = r.engine.discard_free(r.vm, None, true);
    assert_eq!(asks(&r) - before, MAX_DATA_ASKS as u64);
    assert_eq!(first, MAX_DATA_ASKS);
    let round1: Vec<Command> = r.engine.take_commands(r.vm);
    let Some(Command::Watch { gfn: last, .. }) = round1.last() else {
        panic!("watches: {round1:?}");
    };
    assert_eq!(last.0, 2 * (MAX_DATA_ASKS as u32 - 1));
    // The round ends (the guest says not to discard); the next starts past it.
    r.engine.discard_free(r.vm, None, false);
    r.engine
        .guest_categories(r.vm, &runs_of(SIEVE, |g| g % 2 == 0))
        .unwrap();
    r.engine.discard_free(r.vm, None, true);
    let round2 = r.engine.take_commands(r.vm);
    let Some(Command::Watch { gfn, .. }) = round2.first() else {
        panic!("watches: {round2:?}");
    };
    assert_eq!(gfn.0, 2 * MAX_DATA_ASKS as u32);
}

/// One long free run over a sieve of data: a round stops at the ask budget inside
/// it, and the next round, going on from there and wrapping, lists no page twice
/// (seen listing 16 385 pages twice with runs after the wrap not ending where the
/// walk began).
#[test]
fn a_round_stops_inside_a_long_run_and_the_next_lists_no_page_twice() {
    const PAGES: u32 = 3 << 14;
    let mut r = Rig::new(cfg(), PAGES).unwrap();
    for g in (0..PAGES).step_by(2) {
        r.agent.write(Gfn(g), 0, b"data").unwrap();
    }
    let all_free = runs_of(PAGES, |_| true);
    let before = r.agent.ram.file().data_asks;
    r.engine.guest_categories(r.vm, &all_free).unwrap();
    assert_eq!(r.engine.discard_free(r.vm, None, true), MAX_DATA_ASKS);
    assert_eq!(r.agent.ram.file().data_asks - before, MAX_DATA_ASKS as u64);
    r.engine.take_commands(r.vm);
    r.engine.discard_free(r.vm, None, false);
    // Every page holds data now: the next round's runs are whole.
    for g in (1..PAGES).step_by(2) {
        r.agent.write(Gfn(g), 0, b"data").unwrap();
    }
    r.engine.guest_categories(r.vm, &all_free).unwrap();
    assert_eq!(r.engine.discard_free(r.vm, None, true), PAGES as usize);
    let mut watched: Vec<u32> = (r.engine.take_commands(r.vm).iter())
        .filter_map(|c| match *c {
            Command::Watch { gfn, .. } => Some(gfn.0),
            _ => None,
        })
        .collect();
    watched.sort_unstable();
    watched.dedup();
    assert_eq!(watched.len(), PAGES as usize);
}

/// A refill reported before the answer to the discard of a shared page it followed (a
/// QEMU that reports before it answers, `early.rs`): the page is private in the books,
/// as at the agent, and nothing is counted reclaimed. Without parking it, the refill
/// found the page still booked shared and was dropped, and the answer then booked a
/// discarded free page the agent holds private.
#[test]
fn a_refill_before_its_shared_page_s_discard_answer_leaves_the_page_private() {
    let mut r = shared_rig();
    let round = armed_round(&mut r, &[0]);
    report(&mut r, &[0]);
    assert_eq!(r.engine.discard_free(r.vm, Some(round), true), 1);
    let mut held = Vec::new();
    let mut touched = false;
    for c in r.engine.take_commands(r.vm) {
        let o = r.agent.execute(&c);
        if let (Command::DiscardFree { gfn }, Outcome::Done) = (&c, o) {
            // The guest reads the discarded page: the agent fills it (zeros).
            assert_eq!(r.agent.read(*gfn).unwrap(), [0u8; PAGE_SIZE]);
            touched = true;
        }
        held.push((c, o));
    }
    assert!(touched, "the discard was carried out");
    r.report();
    for (c, o) in held {
        r.engine.outcome(r.vm, &c, o);
    }
    assert_eq!(r.engine.page_state(r.vm, Gfn(0)), Some(PageState::Private));
    let b = &r.engine.books().vms[0].books;
    assert_eq!((b.free_reclaimed_pages, b.zero_reclaimed_pages), (0, 0));
    r.engine.check_invariants().unwrap();
    crate::sim::booked_where_kept(&r.engine, r.vm, &r.agent).unwrap();
}

/// A shared page memfoldd asked back to share it without a mapping (`unmapped.rs`),
/// taken back by the agent before its watch, the break reported after the discard was
/// asked (model run 89): the discard's answer must find the page private, as the agent
/// left it. Without the mend the break queued the page's stash (`unmap_broken`), the
/// answer found it stashing and was dropped, and the agent's refusal of the stash (it
/// holds a hole) booked it private: 'booked Private, the agent holds it as Zero'.
#[test]
fn a_page_broken_to_be_unmapped_before_its_discard_s_answer_is_left_for_it() {
    let mut r = shared_rig();
    report(&mut r, &[0]);
    assert_eq!(r.engine.discard_free(r.vm, None, true), 1, "watches");
    // memfoldd's take-back (to unmap page 0) is carried out before the watch; the
    // break it makes is reported only later.
    r.engine
        .vms
        .get_mut(&r.vm)
        .unwrap()
        .unmapping
        .insert(Gfn(0));
    let take_back = Command::TakeBack { gfn: Gfn(0) };
    assert_eq!(r.agent.execute(&take_back), Outcome::Done);
    for c in r.engine.take_commands(r.vm) {
        r.answer(c);
    }
    let round = r.engine.watch_armed(r.vm).expect("armed");
    report(&mut r, &[0]);
    assert_eq!(r.engine.discard_free(r.vm, Some(round), true), 1);
    let held: Vec<_> = (r.engine.take_commands(r.vm).into_iter())
        .map(|c| (r.agent.execute(&c), c))
        .collect();
    assert!(held.contains(&(Outcome::Done, Command::DiscardFree { gfn: Gfn(0) })));
    r.report();
    r.engine.outcome(r.vm, &take_back, Outcome::Done);
    for (o, c) in held {
        r.engine.outcome(r.vm, &c, o);
    }
    r.carry_out();
    crate::sim::booked_where_kept(&r.engine, r.vm, &r.agent).unwrap();
    assert_eq!(r.engine.page_state(r.vm, Gfn(0)), Some(PageState::Zero));
    r.engine.check_invariants().unwrap();
}

/// A discard of a shared page waits (memfoldd's outbox full, or two reports taken in one
/// turn) while the next report starts a new round; the guest then allocates the page
/// and writes it (a CoW break: private); memfoldd sends a flush's watches before its
/// discards. Were the page watched again in the new round, that watch would re-arm its
/// bit after the write and the old discard would punch the guest's bytes out (found by
/// a read-only review, 2026-12-03). A page whose discard is under way is in no new
/// round. Fails with `free_watch.held` pages watched again.
#[test]
fn a_page_whose_discard_waits_is_not_watched_again_by_a_new_round() {
    let mut r = shared_rig();
    let round = armed_round(&mut r, &[0]);
    report(&mut r, &[0]);
    assert_eq!(r.engine.discard_free(r.vm, Some(round), true), 1, "discard");
    let waiting = r.engine.take_commands(r.vm);
    assert!(matches!(
        waiting[..],
        [Command::DiscardFree { gfn: Gfn(0) }]
    ));
    // The next report, page 0 still free: a new round over the free pages.
    report(&mut r, &[0]);
    r.engine.discard_free(r.vm, None, true);
    // The guest allocates page 0 and writes it; the event reaches memfoldd.
    r.agent.write(Gfn(0), 0, b"mine").unwrap();
    r.report();
    // The new round's commands go first, then the waiting discard.
    for c in r.engine.take_commands(r.vm) {
        assert!(
            !matches!(c, Command::Watch { gfn: Gfn(0), .. }),
            "page 0 watched again with its discard under way"
        );
        r.answer(c);
    }
    for c in waiting {
        r.answer(c);
    }
    r.carry_out();
    let mut want = DUP;
    want[..4].copy_from_slice(b"mine");
    let page = r.agent.peek(Gfn(0)).unwrap();
    assert!(page == want, "the guest's write lost: {:?}", &page[..8]);
    r.engine.check_invariants().unwrap();
}
