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
        // INVARIANT: a page whose discard is under way (`free_watch.held`) is in no new
        // round. Its discard may still wait in the queue, and memfoldd sends a flush's
        // watches before its discards: a new watch would set the page's bit again after
        // a write (a CoW break left it private) and the old discard would punch the
        // guest's bytes out (`a_page_whose_discard_waits_is_not_watched_again_by_a_new_round`).
        let end = v.pages();
        let going = |g: Gfn| v.free_watch.held.contains(&g);
        let free =
            |g: u32| map.buddy(Gfn(g)) && v.state(Gfn(g)) == PageState::Private && !going(Gfn(g));
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
            // After the wrap, runs end where the walk began: no page is listed twice.
            let limit = if wrapped { resume } else { end };
            let mut run_end = g + 1;
            while run_end < limit && free(run_end) {
                run_end += 1;
            }
            let mut from = g;
            while from < run_end && want.len() < MAX_WATCH && asks < MAX_DATA_ASKS {
                asks += 1;
                let Some((a, b)) = v.ram.next_data_run(Gfn(from), Gfn(run_end)) else {
                    from = run_end;
                    break;
                };
                let b = b.0.min(run_end);
                let before = want.len();
                want.extend((a.0..b).map(Gfn).take(MAX_WATCH - before));
                from = if want.len() == MAX_WATCH {
                    a.0 + (MAX_WATCH - before) as u32
                } else {
                    b.max(a.0 + 1)
                };
            }
            // Out of budget or room mid-run: the next round goes on from there.
            g = from;
        }
        v.free_watch.resume = if g >= end { 0 } else { g };
        let held = (0..end)
            .map(Gfn)
            .filter(|&g| {
                matches!(
                    v.state(g),
                    PageState::Shared(_) | PageState::Stored(_) | PageState::Unmapped(_)
                )
            })
            .filter(|&g| map.buddy(g) && !going(g));
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
            // It left its frame or blob before the agent's watch (a take-back, a write or a
            // read: that event came first and booked it private), and the agent discarded
            // the private page it then was, unwritten since the watch: a hole now.
            (PageState::Private, Outcome::Done) => {
                let v = self.vms.get_mut(&id).expect("checked");
                v.set_free_hole(g);
                v.books.free_discards += 1;
                return;
            }
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

impl super::Vm {
    /// Whether a request about page `g` is under way that its state does not show: a
    /// page-out, or a free discard asked while it was shared or stored (`free_watch.held`,
    /// until answered), which a CoW break or decode meanwhile left private.
    ///
    /// Invariant: no mechanism starts another request on such a page. The discard's
    /// answer must find the page as the agent left it (private): found sharing,
    /// reclaiming or stashing, the answer was dropped, and the agent's refusal of that
    /// request (it holds a hole) booked the page private — a zero page the books lost
    /// (model run 89: 'booked Private, the agent holds it as Zero'; `unmap_broken` too).
    pub(crate) fn request_going(&self, g: Gfn) -> bool {
        self.paged_out_or_going(g) || self.free_watch.held.contains(&g)
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
mod tests;
