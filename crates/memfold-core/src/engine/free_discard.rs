//! Free pages discarded without copying (issue 17; PV §3.1's "free" pages, which the
//! guest knows and the host cannot): a page the guest reports free is punched out of
//! guest RAM, no content kept, and its next access reads zeros.
//!
//! A report is a sample: a page free when the guest looked may have been allocated and
//! written since. So a discard needs two things, one kept by the agent and one here:
//!
//! 1. **Watch** ([`Command::Watch`]): the agent write-protects the page and sets its
//!    watch bit, which any write, any change of the page's home, or any lifting of the
//!    protection clears (`memfold-agent`'s `Pages::watch`). The agent discards only a
//!    page whose bit is still set.
//! 2. **A report sampled after the watch**: memfoldd asks for a discard only of pages free
//!    in a report the guest was asked for after every watch of the round was answered
//!    ([`Engine::watch_armed`]; the caller says which round a report followed,
//!    [`Engine::discard_free`]).
//!
//! Together: the page was free at an instant after which nothing wrote it, so its bytes
//! are no one's. (A report from before the watch would not do: a page freed, reported,
//! then allocated and written before the watch would be discarded with its new data.)
//!
//! Only frames the guest's buddy allocator marks free ([`crate::categories::PageInfo::buddy`])
//! are candidates: a map count of 0 alone is also every page only the guest's kernel
//! uses.
//!
//! A round: report *k* names free private pages → they are watched → all answered: the
//! round is armed → report *k + 1*, asked after that, confirms which are still free → those
//! are discarded ([`Command::DiscardFree`], state `Reclaiming` until answered, then a
//! reclaimed zero page: refilled with zeros on access). A private page the guest reports
//! free the Difference Engine leaves for the discard rather than storing it
//! (`Engine::free_for_discard`).
//!
//! Pages the guest reports free that are **shared or stored** go the same way (Satori
//! §4.3's no-copy-on-write, per page instead of per reported 2 MiB block): the agent's
//! watch of such a page is only its bit (the page is protected already: a write breaks
//! the share or decodes it, a new home, which ends the watch), and a discard drops the
//! frame's mapping or the blob. The engine leaves their state as it is until the agent
//! answers — as a take-back does — so a CoW break or decode under way is booked by its
//! own event; a done answer finds the page still shared or stored and releases the frame
//! reference or blob (`Engine::discard_outcome`).

use super::{Command, Engine, Outcome};
use crate::ids::{Gfn, VmId};
use crate::p2m::PageState;

/// Most pages one watch round asks to watch (1 GiB of guest RAM): each costs a
/// write-protection, and a write fault if the guest writes it before the discard. Only
/// pages that hold data in guest RAM are watched.
pub const MAX_WATCH: usize = 1 << 18;

/// Most times one round asks the guest's RAM where its data lies (`SEEK_DATA`/`SEEK_HOLE`
/// within a run of free pages): the walk's cost to memfoldd's main loop, whatever the
/// guest's RAM and report look like. The next round goes on from where it stopped.
pub const MAX_DATA_ASKS: usize = 1 << 14;

/// A watch round of one guest, numbered from 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WatchRound(pub u64);

/// One guest's free-page watch.
#[derive(Clone, Debug, Default)]
pub(crate) struct FreeWatch {
    /// Whether its last report allowed discards (no page poisoning), and discards are on.
    pub(crate) allowed: bool,
    /// The round under way or armed (0: none yet).
    round: u64,
    /// Watch commands of the round not yet answered.
    pending: u32,
    /// Pages the agent said it watches in this round.
    watched: Vec<Gfn>,
    /// Where the next round's walk of free runs starts (it stopped there, out of budget).
    resume: u32,
    /// Shared or stored pages whose discard is under way (their state unchanged until
    /// the answer): how the answer is told from a private page's, whose state is
    /// `Reclaiming`. Cleared when the agent attaches again (answers in doubt are lost).
    pub(crate) held: std::collections::HashSet<Gfn>,
}

impl FreeWatch {
    /// Ends the round: the agent's connection ended, or the guest may not be discarded.
    /// The next round has a new number, so answers still coming for this one are
    /// ignored.
    pub(crate) fn end(&mut self) {
        self.round += 1;
        self.pending = 0;
        self.watched = Vec::new();
    }
}

impl Engine {
    /// Guest `id`'s armed watch round: every watch of it answered, some page watched.
    /// The caller notes when it learned this; a report the guest was asked for after
    /// that may discard the round's pages ([`Engine::discard_free`]).
    pub fn watch_armed(&self, id: VmId) -> Option<WatchRound> {
        let w = &self.vms.get(&id)?.free_watch;
        (w.round > 0 && w.pending == 0 && !w.watched.is_empty()).then_some(WatchRound(w.round))
    }

    /// After guest `id`'s report of its categories ([`Engine::guest_categories`]), asked
    /// for after round `sampled_after` was armed (`None`: before any armed round, or not
    /// known): with [`super::EngineConfig::discard_free`] on and the guest `discardable`
    /// (its kernel does not check free pages' old bytes: no page poisoning), either
    /// discards the armed round's pages the report still shows free, or, with no round
    /// under way, starts one over the private pages it shows free. Returns the pages
    /// asked for (discards, or watches).
    pub fn discard_free(
        &mut self,
        id: VmId,
        sampled_after: Option<WatchRound>,
        discardable: bool,
    ) -> usize {
        let on = self.cfg.discard_free && self.cfg.guest_categories;
        let Some(v) = self.vms.get_mut(&id).filter(|v| v.attached && !v.opted_out) else {
            return 0;
        };
        v.free_watch.allowed = on && discardable;
        if !on {
            return 0;
        }
        let Some(map) = v.categories.as_ref() else {
            return 0;
        };
        if !discardable {
            v.free_watch.end();
            return 0;
        }
        let w = &mut v.free_watch;
        if w.pending > 0 {
            // Watches under way: this report may predate them.
            return 0;
        }
        if !w.watched.is_empty() {
            if sampled_after != Some(WatchRound(w.round)) {
                return 0;
            }
            let still_free: Vec<Gfn> = std::mem::take(&mut w.watched)
                .into_iter()
                .filter(|&g| map.buddy(g) && discardable_state(v.state(g)))
                .collect();
            let mut asked = 0;
            for g in still_free {
                if v.free_watch.held.contains(&g) {
                    continue; // a discard of it under way already
                }
                if v.state(g) == PageState::Private {
                    v.set(g, PageState::Reclaiming);
                } else {
                    v.free_watch.held.insert(g);
                }
                v.queue.push(Command::DiscardFree { gfn: g });
                asked += 1;
            }
            v.books.free_discard_asks += asked as u64;
            return asked;
        }
        w.round += 1;
        let w_round = w.round;
        // Only pages that hold data: a hole (never touched, or punched already) costs the
        // host nothing, and would be booked as saved. Shared and stored pages are holes in
        // guest RAM: found in the P2M.
        //
        // Only free runs are asked for data (a system call or two each), a budget of
        // them a round, from where the last round stopped: a guest whose RAM is a sieve
        // of holes, reporting few pages free, must not cost memfoldd's main loop a walk
        // of every data run of its RAM at every report.
        let end = v.pages();
        let free = |g: u32| map.buddy(Gfn(g)) && v.state(Gfn(g)) == PageState::Private;
        let resume = v.free_watch.resume.min(end);
        let (mut want, mut asks, mut g) = (Vec::new(), 0, resume);
        let mut wrapped = false;
        while want.len() < MAX_WATCH && asks < MAX_DATA_ASKS {
            if g >= end {
                if wrapped || resume == 0 {
                    g = end;
                    break;
                }
                (g, wrapped) = (0, true);
            }
            if wrapped && g >= resume {
                break;
            }
            if !free(g) {
                g += 1;
                continue;
            }
            let mut run_end = g + 1;
            while run_end < end && free(run_end) {
                run_end += 1;
            }
            let mut from = g;
            while from < run_end && want.len() < MAX_WATCH {
                asks += 1;
                let Some((a, b)) = v.ram.next_data_run(Gfn(from), Gfn(run_end)) else {
                    break;
                };
                let b = b.0.min(run_end);
                want.extend((a.0..b).map(Gfn).take(MAX_WATCH - want.len()));
                from = b.max(a.0 + 1);
            }
            g = run_end;
        }
        let w = &mut v.free_watch;
        w.resume = if g >= end { 0 } else { g };
        let held = (0..end)
            .map(Gfn)
            .filter(|&g| {
                matches!(
                    v.state(g),
                    PageState::Shared(_) | PageState::Stored(_) | PageState::Unmapped(_)
                )
            })
            .filter(|&g| map.buddy(g));
        want.extend(held.take(MAX_WATCH - want.len()));
        let asked = want.len();
        for gfn in want {
            v.queue.push(Command::Watch {
                gfn,
                round: WatchRound(w_round),
            });
        }
        v.free_watch.pending = asked as u32;
        v.books.free_watches += asked as u64;
        asked
    }

    /// The agent's answer to a watch of guest `id`'s page `g` in `round`. An answer for
    /// an earlier round counts for nothing: that round ended while its watches were under
    /// way, and counting it would arm the new round before all its pages are watched.
    pub(crate) fn watch_outcome(&mut self, id: VmId, g: Gfn, round: WatchRound, o: Outcome) {
        let Some(v) = self.vms.get_mut(&id) else {
            return;
        };
        let w = &mut v.free_watch;
        if round != WatchRound(w.round) || w.pending == 0 {
            return;
        }
        w.pending -= 1;
        if o == Outcome::Lost {
            // The round is incomplete: its watched pages can no longer be known whole.
            w.end();
        } else if o == Outcome::Done {
            w.watched.push(g);
        }
    }

    /// Whether private page `g` of guest `id` is the free-page discard's to take: its
    /// guest may be discarded and its last report, at most [`super::de::GUEST_R_MAX_AGE_US`]
    /// old, shows the page free (its buddy allocator's). The Difference Engine leaves such
    /// a page alone: a store would keep its dead bytes and decode them at its reuse,
    /// where the discard keeps nothing and the reuse reads zeros.
    pub(crate) fn free_for_discard(&self, id: VmId, g: Gfn) -> bool {
        let now = self.now_us();
        self.vms.get(&id).is_some_and(|v| {
            v.free_watch.allowed && v.fresh_categories(now).is_some_and(|m| m.buddy(g))
        })
    }

    /// The agent's answer to a discard of guest `id`'s free page `g`: a private page's
    /// (state `Reclaiming`) as a zero-page reclaim's; a shared or stored page's, done,
    /// releases the frame reference or the blob, and the page is a discarded free page.
    /// A shared or stored page that is no longer so was answered `Changed` (the agent
    /// saw the write or decode first) and its event did the books.
    pub(crate) fn discard_outcome(&mut self, id: VmId, g: Gfn, o: Outcome) {
        let Some(v) = self.vms.get_mut(&id) else {
            return;
        };
        if !v.free_watch.held.remove(&g) {
            if self.punched_outcome(id, g, o, true) {
                self.vms.get_mut(&id).expect("checked").books.free_discards += 1;
            }
            return;
        }
        let (shared, stored) = match (v.state(g), o) {
            (PageState::Shared(f), Outcome::Done) => (self.take_shared(id, g, f), false),
            (PageState::Stored(_) | PageState::Moving(_), Outcome::Done) => {
                (false, self.take_stored(id, g).is_some())
            }
            // To the agent a page shared without a mapping is stashed too.
            (PageState::Unmapped(_), Outcome::Done) => (false, self.take_unmapped(id, g).is_some()),
            _ => return,
        };
        if shared || stored {
            let v = self.vms.get_mut(&id).expect("checked");
            v.set_free_hole(g);
            v.books.free_discards += 1;
            v.books.free_discards_shared += u64::from(shared);
            v.books.free_discards_stored += u64::from(stored);
        }
    }
}

/// Whether a page in state `s` may be discarded when its guest reports it free: private,
/// shared, stored or shared without a mapping (not in flight, not a zero page already).
fn discardable_state(s: PageState) -> bool {
    matches!(
        s,
        PageState::Private | PageState::Shared(_) | PageState::Stored(_) | PageState::Unmapped(_)
    )
}

#[cfg(test)]
mod tests {
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
        (0..PAGES)
            .map(|g| CategoryRun {
                first: Gfn(g),
                count: 1,
                info: PageInfo {
                    category: if free.contains(&g) {
                        Category::Free
                    } else {
                        Category::Anon
                    },
                    active: false,
                    referenced: false,
                    buddy: free.contains(&g),
                    never_share: false,
                },
            })
            .collect()
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
        report(&mut r, &[0, 1, 2]);
        assert_eq!(r.engine.discard_free(r.vm, None, true), 3, "watches");
        r.carry_out();
        let round = r.engine.watch_armed(r.vm).expect("armed");
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
        report(&mut r, &[0]);
        assert_eq!(r.engine.discard_free(r.vm, None, true), 1);
        r.carry_out();
        let round = r.engine.watch_armed(r.vm).expect("armed");
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

    /// Stored pages the guest reports free are dropped from the store (their blobs
    /// released) once a later report still shows them free; a page decoded by a read
    /// after its watch is not (its bytes are back in RAM, and the watch ended).
    #[test]
    fn stored_pages_reported_free_release_their_blobs() {
        let text = |g: u32| -> Vec<u8> {
            let line = format!("page {g}: a line of text that a guest keeps in a file. ");
            line.bytes().cycle().take(PAGE_SIZE).collect()
        };
        let cfg = EngineConfig {
            discard_free: true,
            ..crate::sim::quick_config(Policy::difference_engine())
        };
        let mut r = Rig::new(cfg, PAGES).unwrap();
        for g in 0..PAGES {
            r.agent.write(Gfn(g), 0, &text(g)).unwrap();
        }
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
        report(&mut r, &free);
        assert_eq!(r.engine.discard_free(r.vm, None, true), free.len());
        r.carry_out();
        let round = r.engine.watch_armed(r.vm).expect("armed");
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
        let text = |g: u32| -> Vec<u8> {
            let line = format!("page {g}: a line of text that a guest keeps in a file. ");
            line.bytes().cycle().take(PAGE_SIZE).collect()
        };
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
            let cfg = EngineConfig {
                discard_free: true,
                ..crate::sim::quick_config(Policy::difference_engine())
            };
            let mut r = Rig::new(cfg, PAGES).unwrap();
            for g in 0..PAGES {
                r.agent.write(Gfn(g), 0, &text(g)).unwrap();
            }
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
        let sieve_report = |free: &dyn Fn(u32) -> bool| -> Vec<CategoryRun> {
            (0..SIEVE)
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
        };
        let before = asks(&r);
        r.engine
            .guest_categories(r.vm, &sieve_report(&|_| false))
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
            .guest_categories(r.vm, &sieve_report(&|g| g % 2 == 0))
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
            .guest_categories(r.vm, &sieve_report(&|g| g % 2 == 0))
            .unwrap();
        r.engine.discard_free(r.vm, None, true);
        let round2 = r.engine.take_commands(r.vm);
        let Some(Command::Watch { gfn, .. }) = round2.first() else {
            panic!("watches: {round2:?}");
        };
        assert_eq!(gfn.0, 2 * MAX_DATA_ASKS as u32);
    }
}
