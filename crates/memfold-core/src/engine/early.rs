//! Events an agent reports before its answer to the request they followed.
//!
//! The real agent answers a request before it reports what it served meanwhile (a CoW
//! break, a refill, a decode of the page just taken; `memfold-agent`'s requests.rs). A
//! QEMU that does not — a bug, or a guest escaped into it — would otherwise have its event
//! dropped (the page is still in flight, so it matches nothing) and then the answer book
//! the page as shared, reclaimed or stored while its agent holds it privately: a frame
//! no one maps kept for the guest's life, a saving counted that is not there.
//!
//! Invariant: an event that the page's pending answer would make apply is parked and
//! applied right after that answer, whatever the answer is; at most one is parked a page
//! in flight (the first: it moves the page back into RAM, so no later one can match the
//! same holding), so a flood costs memfoldd no more than the requests it sent. A lost
//! answer leaves it parked until the agent attaches again, whose mappings are then the
//! truth. The one exception: the first page-in after a page-out whose answer was lost is
//! that page-out's as likely as the next one's, and in the normal order: applied at once.

use super::{Discard, Engine};
use crate::ids::{FrameId, Gfn, VmId};
use crate::p2m::PageState;

/// An event parked until its page's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Early {
    /// [`Engine::cow_broken`] from this frame.
    CowBroken(FrameId),
    /// [`Engine::refilled`].
    Refilled,
    /// [`Engine::unstashed`].
    Unstashed,
    /// [`Engine::discarded`].
    Discarded(Discard),
    /// [`Engine::paged_in`].
    PagedIn,
}

impl Engine {
    /// Parks event `e` of guest `id`'s page `g` if the page waits for the answer that
    /// would make `e` apply (a share onto the frame `e` left, a reclaim, a stash, a
    /// page-out, a free page's discard).
    /// Returns whether it was parked (the caller then does nothing more now).
    pub(crate) fn park_early(&mut self, id: VmId, g: Gfn, e: Early) -> bool {
        let Some(v) = self
            .vms
            .get_mut(&id)
            .filter(|v| v.attached && g.0 < v.pages())
        else {
            return false;
        };
        // The first page-in after a page-out whose answer was lost may be that one's,
        // reported in the normal order: applied at once (parked, it unmarked the page the
        // next page-out took out). Only the real agent loses answers (with its
        // connection), so this costs a lying one nothing it could use.
        let lost = e == Early::PagedIn && v.lost_page_outs.remove(&g);
        let waits = !lost && v.waits_for_answer(g, e);
        if waits {
            tracing::debug!(vm = %id, gfn = %g, event = ?e, "an event before its answer: parked");
            v.early.entry(g).or_insert(e);
        }
        waits
    }

    /// The answer for guest `id`'s page `g` is in: the event parked for it, if any,
    /// applies now (and is ignored, as any stale event, if the page did not end where
    /// the event says it was).
    pub(crate) fn replay_early(&mut self, id: VmId, g: Gfn) {
        let Some(e) = self.vms.get_mut(&id).and_then(|v| v.early.remove(&g)) else {
            return;
        };
        match e {
            Early::CowBroken(f) => self.cow_broken(id, g, f),
            Early::Refilled => self.refilled(id, g),
            Early::Unstashed => self.unstashed(id, g),
            Early::Discarded(what) => self.discarded(id, g, what),
            Early::PagedIn => self.paged_in(id, &[g]),
        }
    }
}

impl super::Vm {
    /// Whether event `e` of page `g` waits for the answer of the request the page is in
    /// flight for (a share onto the frame `e` left, a reclaim, a stash, a page-out, a
    /// free page's discard): what
    /// parks it, and what every parked event must still meet (`check_invariants`).
    pub(crate) fn waits_for_answer(&self, g: Gfn, e: Early) -> bool {
        match (self.state(g), e) {
            (PageState::Sharing(s), Early::CowBroken(f) | Early::Discarded(Discard::Frame(f))) => {
                s == f
            }
            (PageState::Reclaiming, Early::Refilled | Early::Discarded(Discard::Zero)) => true,
            // A discard of a free page that was shared, stored or unmapped: its answer
            // makes the page a hole, which a refill or a discard follows (the state
            // stays as it was until then, `free_discard.rs`).
            (
                PageState::Shared(_)
                | PageState::Stored(_)
                | PageState::Moving(_)
                | PageState::Unmapped(_),
                Early::Refilled | Early::Discarded(Discard::Zero),
            ) => self.free_watch.held.contains(&g),
            (PageState::Stashing(_), Early::Unstashed | Early::Discarded(Discard::Stored)) => true,
            (PageState::Private, Early::PagedIn) => {
                self.hints.page_out_going(g) && !self.p2m[g.index()].is_paged_out()
            }
            _ => false,
        }
    }

    /// Page `g`'s page-out was forgotten (the engine moved the page on before its
    /// answer): a page-in parked for that answer is stale, and would hold the page's one
    /// slot against its next event — dropped, as the invariant above needs.
    pub(crate) fn drop_stale_page_in(&mut self, g: Gfn) {
        if self.early.get(&g) == Some(&Early::PagedIn) {
            self.early.remove(&g);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Command, Outcome};
    use crate::ids::Gfn;
    use crate::p2m::PageState;
    use crate::sim::{quick_config, Rig};
    use crate::{Policy, PAGE_SIZE};

    const PAGES: u32 = 64;

    /// Four identical text pages (shared), zero pages written (reclaimed), unique text
    /// pages (stored once cold).
    fn rig() -> Rig {
        let mut r = Rig::new(quick_config(Policy::difference_engine()), PAGES).unwrap();
        for g in 0..PAGES {
            let seed = if g < 4 { 0 } else { g };
            let bytes: Vec<u8> = if !(4..16).contains(&g) {
                let words = format!("page {seed} of the early-event test, ");
                words.bytes().cycle().take(PAGE_SIZE).collect()
            } else {
                vec![0; PAGE_SIZE]
            };
            r.agent.write(Gfn(g), 0, &bytes).unwrap();
        }
        r
    }

    /// Steps `r` until a command `pick` names is done; the agent then touches that page
    /// (a write if `write`, else a read) and reports the event before every answer of
    /// that step. Returns the page.
    fn touched_before_answer(r: &mut Rig, pick: fn(&Command) -> Option<Gfn>, write: bool) -> Gfn {
        let mut target = None;
        for _ in 0..2000 {
            r.clock.advance(10_000);
            r.engine.scan_step().unwrap();
            r.engine.clock_step();
            let mut held = Vec::new();
            for c in r.engine.take_commands(r.vm) {
                if r.agent.clock_scan_cmd(&c).is_some() {
                    r.answer(c);
                    continue;
                }
                let o = r.agent.execute(&c);
                if let (None, Outcome::Done, Some(g)) = (target, o, pick(&c)) {
                    if write {
                        r.agent.write(g, 8, b"the guest's own").unwrap();
                    } else {
                        r.agent.read(g).unwrap();
                    }
                    target = Some(g);
                }
                held.push((c, o));
            }
            r.report();
            for (c, o) in held {
                r.engine.outcome(r.vm, &c, o);
            }
            if let Some(g) = target {
                return g;
            }
        }
        panic!("no such command in 2000 steps");
    }

    /// Every page is booked where the agent keeps it, paged out both ways (no answer was
    /// lost), and the engine's invariants hold.
    fn books_agree(r: &Rig) {
        r.engine.check_invariants().unwrap();
        crate::sim::booked_where_kept(&r.engine, r.vm, &r.agent).unwrap();
        for g in (0..PAGES).map(Gfn) {
            let out = r.agent.is_paged_out(g);
            assert_eq!(
                r.engine.page_paged_out(r.vm, g),
                out,
                "{g}: paged out at the agent"
            );
        }
    }

    /// A CoW break reported before the share's answer: the page is private in the books
    /// and its frame reference released (dropping the break booked it shared for good).
    #[test]
    fn a_break_before_its_share_answer_leaves_the_page_private() {
        let mut r = rig();
        let g = touched_before_answer(
            &mut r,
            |c| match *c {
                Command::Share { gfn, .. } => Some(gfn),
                _ => None,
            },
            true,
        );
        assert_eq!(r.engine.page_state(r.vm, g), Some(PageState::Private));
        assert_eq!(r.engine.books().vms[0].books.cow_breaks, 1);
        books_agree(&r);
    }

    /// A refill reported before the reclaim's answer: private again, nothing saved.
    #[test]
    fn a_refill_before_its_reclaim_answer_leaves_the_page_private() {
        let mut r = rig();
        let g = touched_before_answer(
            &mut r,
            |c| match *c {
                Command::Reclaim { gfn } => Some(gfn),
                _ => None,
            },
            false,
        );
        assert_eq!(r.engine.page_state(r.vm, g), Some(PageState::Private));
        assert_eq!(r.engine.books().vms[0].books.refills, 1);
        books_agree(&r);
    }

    /// A decode reported before the stash's answer: private again, its blob released.
    #[test]
    fn a_decode_before_its_stash_answer_leaves_the_page_private() {
        let mut r = rig();
        let g = touched_before_answer(
            &mut r,
            |c| match *c {
                Command::Stash { gfn, stash, .. } if !stash.moving => Some(gfn),
                _ => None,
            },
            false,
        );
        assert_eq!(r.engine.page_state(r.vm, g), Some(PageState::Private));
        assert_eq!(r.engine.books().vms[0].books.unstashes, 1);
        books_agree(&r);
    }

    /// A page-in reported before the page-out's answer: the page is not booked as out
    /// (it would count as saved while in RAM, and never be offered again).
    #[test]
    fn a_page_in_before_its_page_out_answer_leaves_the_page_in_ram() {
        let mut r = zswap_rig();
        let g = touched_before_answer(
            &mut r,
            |c| match *c {
                Command::PageOut { gfn } => Some(gfn),
                _ => None,
            },
            false,
        );
        assert!(!r.agent.is_paged_out(g));
        assert!(!r.engine.page_paged_out(r.vm, g), "{g}: booked out, in RAM");
        books_agree(&r);
    }

    /// Distinct text pages, compressed by paging them out to the kernel's swap.
    fn zswap_rig() -> Rig {
        let mut cfg = quick_config(Policy::difference_engine());
        cfg.compress_backing = crate::engine::CompressBacking::Zswap;
        let mut r = Rig::new(cfg, PAGES).unwrap();
        for g in 0..PAGES {
            let words = format!("page {g} of the early page-out test, ");
            let bytes: Vec<u8> = words.bytes().cycle().take(PAGE_SIZE).collect();
            r.agent.write(Gfn(g), 0, &bytes).unwrap();
        }
        r
    }

    /// A page-out done whose answer was lost, the page read back in, and a new page-out
    /// of it asked and done: the page-in the agent reports before the new answer is the
    /// old page-out's, in the normal order. It must not wait for the new answer (it then
    /// unmarked a page the new one had paged out: booked in RAM while out). Fails
    /// without `lost_page_outs`.
    #[test]
    fn a_page_in_of_a_page_out_whose_answer_was_lost_is_not_parked() {
        let mut r = zswap_rig();
        let mut lost = None;
        for _ in 0..2000 {
            r.clock.advance(10_000);
            r.engine.scan_step().unwrap();
            r.engine.clock_step();
            for c in r.engine.take_commands(r.vm) {
                if r.agent.clock_scan_cmd(&c).is_some() {
                    r.answer(c);
                    continue;
                }
                let o = r.agent.execute(&c);
                match c {
                    Command::PageOut { gfn } if lost.is_none() && o == Outcome::Done => {
                        r.engine.outcome(r.vm, &c, Outcome::Lost);
                        lost = Some(gfn);
                    }
                    _ => r.engine.outcome(r.vm, &c, o),
                }
            }
            r.report();
            if lost.is_some() {
                break;
            }
        }
        let g = lost.expect("a page-out in 2000 steps");
        assert!(r.agent.is_paged_out(g) && !r.engine.page_paged_out(r.vm, g));
        // The guest reads it back in; the agent's page-in waits in its report until the
        // engine pages the page out again (once the clock finds it cold), done at once.
        r.agent.read(g).unwrap();
        for _ in 0..20_000 {
            r.clock.advance(10_000);
            r.engine.scan_step().unwrap();
            r.engine.clock_step();
            let mut held = None;
            for c in r.engine.take_commands(r.vm) {
                if r.agent.clock_scan_cmd(&c).is_some() {
                    r.answer(c);
                    continue;
                }
                let o = r.agent.execute(&c);
                if c == (Command::PageOut { gfn: g }) && o == Outcome::Done {
                    held = Some((c, o));
                } else {
                    r.engine.outcome(r.vm, &c, o);
                }
            }
            if let Some((c, o)) = held {
                r.report();
                r.engine.outcome(r.vm, &c, o);
                assert!(r.engine.page_paged_out(r.vm, g), "{g}: booked in RAM, out");
                books_agree(&r);
                return;
            }
        }
        panic!("{g} not paged out again");
    }

    /// A page-in parked before its page-out's answer, then the page moved on by the engine
    /// itself (a disk read lands on it and shares it at read): the page-out's answer will
    /// mark nothing, so the parked page-in is stale. A CoW break of the new share, also
    /// reported before its answer, must park in its place — not be dropped while the
    /// stale page-in holds the page's one slot (the share's answer then booked the page
    /// shared while the agent held it private). Fails without the stale page-in dropped.
    #[test]
    fn a_break_after_a_stale_early_page_in_is_not_dropped() {
        let mut r = zswap_rig();
        // A page-out done, its answer held; the guest reads the page back in and the
        // agent reports that first.
        let mut held = None;
        for _ in 0..2000 {
            r.clock.advance(10_000);
            r.engine.scan_step().unwrap();
            r.engine.clock_step();
            for c in r.engine.take_commands(r.vm) {
                if held.is_none() && matches!(c, Command::PageOut { .. }) {
                    let o = r.agent.execute(&c);
                    if o == Outcome::Done {
                        held = Some((c, o));
                        continue;
                    }
                    r.engine.outcome(r.vm, &c, o);
                    continue;
                }
                r.answer(c);
            }
            r.report();
            if held.is_some() {
                break;
            }
        }
        let (out_cmd, out_o) = held.expect("a page-out in 2000 steps");
        let Command::PageOut { gfn: g } = out_cmd else {
            unreachable!()
        };
        r.agent.read(g).unwrap();
        r.report(); // the page-in, parked
                    // A disk read lands the same block in another page and then in `g`: shared at read.
        let other = Gfn((g.0 + 1) % PAGES);
        let block: Vec<u8> = b"one block read twice, "
            .iter()
            .copied()
            .cycle()
            .take(PAGE_SIZE)
            .collect();
        r.agent.write(other, 0, &block).unwrap();
        r.report();
        r.engine.read_landed(r.vm, &[other], 0);
        r.agent.write(g, 0, &block).unwrap();
        r.report();
        r.engine.read_landed(r.vm, &[g], 0);
        assert!(
            matches!(r.engine.page_state(r.vm, g), Some(PageState::Sharing(_))),
            "{g}: not shared at read: {:?}",
            r.engine.page_state(r.vm, g)
        );
        // No event parked for a request the page is no longer in flight for.
        r.engine.check_invariants().unwrap();
        // The shares done; the guest writes `g` (a CoW break) before their answers.
        let mut answers = Vec::new();
        for c in r.engine.take_commands(r.vm) {
            let o = r.agent.execute(&c);
            answers.push((c, o));
        }
        r.agent.write(g, 8, b"the guest's own").unwrap();
        r.report();
        r.engine.outcome(r.vm, &out_cmd, out_o);
        for (c, o) in answers {
            r.engine.outcome(r.vm, &c, o);
        }
        r.carry_out();
        assert_eq!(r.engine.page_state(r.vm, g), Some(PageState::Private));
        books_agree(&r);
    }
}
