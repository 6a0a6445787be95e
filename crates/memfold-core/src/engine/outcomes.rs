//! What the agents did, applied back to the books: answers to commands, and the events of
//! pages that came back into guest RAM on their own (CoW breaks, refills, decodes) or
//! that the guest's VMM discarded (a balloon, free page reporting, virtio-mem).

use super::early::Early;
use super::{Command, Engine, Outcome};
use crate::blobs::Kept;
use crate::ids::{FrameId, Gfn, VmId};
use crate::p2m::{BlobId, PageState};

/// Whether a page in state `s` is one memfold holds outside the guest's own RAM (or as a
/// hole it refills), which an opt-out takes back.
fn g_taken_back(s: PageState) -> bool {
    matches!(
        s,
        PageState::Shared(_) | PageState::Stored(_) | PageState::Unmapped(_) | PageState::Zero
    )
}

/// What memfold held of a page that QEMU discarded (its RAM punched and unmapped: a
/// balloon inflating, free page reporting, virtio-mem unplugging), as the agent last knew
/// it. A discard matches the engine's state exactly or is ignored, so a report that
/// crossed a later command on the wire changes nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Discard {
    /// The page was mapped onto this pool frame.
    Frame(FrameId),
    /// A reclaimed zero page.
    Zero,
    /// A stored page (a blob in the store or the swap file), or a page shared without a
    /// mapping: to the agent both are stashed.
    Stored,
}

impl Engine {
    /// The guest's VMM discarded page `g`, which memfold held as `what` (KSM's unmerge of a
    /// discarded range: `MADV_DONTNEED`/`MADV_REMOVE` on a merged page drops the merge).
    /// The page is a hole in guest RAM again, private and reading as zeros; the frame's
    /// reference or the blob is released, so the saving goes with the page. Counted in
    /// [`super::VmBooks::discards`]. A report that does not match the page's state (the
    /// page changed since, or the guest is gone) is ignored.
    pub fn discarded(&mut self, id: VmId, g: Gfn, what: Discard) {
        if self.park_early(id, g, Early::Discarded(what)) {
            return;
        }
        let shared = matches!(what, Discard::Frame(_));
        let taken = match what {
            Discard::Frame(f) => self.take_shared(id, g, f),
            Discard::Zero => self.take_zero(id, g),
            // Not an access: no lifetime recorded, no wait before storing it again.
            Discard::Stored => {
                self.take_stored(id, g).is_some() || self.take_unmapped(id, g).is_some()
            }
        };
        if taken {
            let books = &mut self.vms.get_mut(&id).expect("taken").books;
            books.discards += 1;
            if shared {
                books.cow_copies_avoided += 1;
            }
        }
    }

    /// Applies the agent's answer to a command of guest `id`. A [`Outcome::Lost`] answer
    /// changes nothing: the page stays in doubt (see [`Outcome::Lost`]). Answers for a
    /// guest removed meanwhile, or that do not match the page's state, only release what
    /// the command held.
    pub fn outcome(&mut self, id: VmId, cmd: &Command, o: Outcome) {
        if let Command::Fill { gfn, frame, .. } = *cmd {
            // The device hears of every fill, whatever became of it.
            let mapped = o == Outcome::Done
                && self
                    .vms
                    .get(&id)
                    .is_some_and(|v| v.attached && v.state(gfn) == PageState::Sharing(frame));
            self.fill_answered(id, gfn, mapped);
        }
        if let Command::Watch { gfn, round } = *cmd {
            // A watch holds no page state: every answer, a lost one too, ends it.
            self.watch_outcome(id, gfn, round, o);
            return;
        }
        match self.vms.get_mut(&id) {
            Some(v) if o == Outcome::Lost => {
                v.books.lost += 1;
                if let Command::PageOut { gfn } = *cmd {
                    // In doubt, but not to be skipped for good: at worst the next read
                    // swaps it back in (the agent then reports it paged in).
                    if gfn.0 < v.pages() {
                        v.hints.take_page_out_going(gfn);
                        // Maybe done: its page-in may come yet (`early`).
                        v.lost_page_outs.insert(gfn);
                    }
                    // A page-in reported early: in RAM, as the books already say.
                    v.early.remove(&gfn);
                }
                return;
            }
            // Once a guest is detached (or removed) no answer reaches the books: its sent
            // requests were all lost, and blob ids are reused.
            Some(v) if v.attached => {}
            _ => return,
        }
        let gfn = match *cmd {
            Command::Share { gfn, frame } | Command::Fill { gfn, frame, .. } => {
                self.share_outcome(id, gfn, frame, o);
                gfn
            }
            Command::Reclaim { gfn } => {
                self.reclaim_outcome(id, gfn, o);
                gfn
            }
            Command::PageOut { gfn } => {
                self.page_out_outcome(id, gfn, o);
                self.replay_early(id, gfn);
                return;
            }
            Command::DiscardFree { gfn } => {
                self.count_answer(id, o, false);
                self.discard_outcome(id, gfn, o);
                gfn
            }
            Command::Stash { gfn, blob, stash } => {
                if stash.moving {
                    self.move_outcome(id, gfn, blob, o)
                } else {
                    self.stash_outcome(id, gfn, blob, o)
                }
                gfn
            }
            // Done: its events did the books. Refused (a page the agent could not take
            // back): left as it is until the operator asks again (`opt_out` is idempotent).
            // A take-back memfoldd asked to share the page without a mapping: refused, or
            // done without a break (the page was no longer shared), it ends here.
            Command::TakeBack { gfn } => {
                let v = self.vms.get_mut(&id).expect("checked");
                let unmapping =
                    if o != Outcome::Done || !matches!(v.state(gfn), PageState::Shared(_)) {
                        v.unmapping.remove(&gfn)
                    } else {
                        v.unmapping.contains(&gfn)
                    };
                if o != Outcome::Done && o != Outcome::NotSent && !unmapping {
                    v.books.take_back_refused += 1;
                }
                return;
            }
            Command::ClockScan { .. } | Command::Watch { .. } => return,
        };
        self.replay_early(id, gfn);
        // A request under way when the operator opted the guest out ended with the page
        // shared, stored or reclaimed after all: take it back too.
        let v = self.vms.get_mut(&id).expect("outcome() checked");
        if v.opted_out && g_taken_back(v.state(gfn)) {
            v.queue.push(Command::TakeBack { gfn });
        }
        // Likewise one under way when its guest marked the page never-share, or when its
        // frame was withdrawn: the report, and the pass, found it on no frame yet.
        self.never_share_landed(id, gfn);
    }

    /// The operator takes guest `id` out of memfold (KSM's `MADV_UNMERGEABLE` for a whole
    /// VM): from now on none of its pages is shared, stored, reclaimed, or used as a hint
    /// or reference page, and each page memfold holds is taken back into its RAM
    /// ([`Command::TakeBack`]; requests under way are taken back when they end). Returns
    /// the pages queued; `None` if there is no such guest.
    pub fn opt_out(&mut self, id: VmId) -> Option<u32> {
        let v = self.vms.get_mut(&id)?;
        v.opted_out = true;
        v.books.opted_out = true;
        // Shares, reclaims and stashes not yet sent are dropped (their pages stay as they
        // are); clock scans and take-backs stay.
        let (dropped, kept): (Vec<Command>, Vec<Command>) =
            std::mem::take(&mut v.queue).into_iter().partition(|c| {
                matches!(
                    c,
                    Command::Share { .. }
                        | Command::Fill { .. }
                        | Command::Reclaim { .. }
                        | Command::DiscardFree { .. }
                        | Command::Watch { .. }
                        | Command::Stash { .. }
                )
            });
        v.queue = kept;
        for c in &dropped {
            self.outcome(id, c, Outcome::NotSent);
        }
        let v = self.vms.get_mut(&id).expect("checked");
        let queued = v.queued_take_backs();
        let mut n = 0;
        for i in 0..v.pages() {
            let g = Gfn(i);
            if g_taken_back(v.state(g)) && !queued.contains(&g) {
                v.queue.push(Command::TakeBack { gfn: g });
                n += 1;
            }
        }
        tracing::info!(vm = %id, name = %v.name, pages = n, "opted out by the operator: taking its pages back");
        Some(n)
    }

    /// Whether the operator opted guest `id` out (false for an unknown guest).
    pub fn is_opted_out(&self, id: VmId) -> bool {
        self.vms.get(&id).is_some_and(|v| v.opted_out)
    }

    /// Guest `id` is managed again after [`Engine::opt_out`]. Returns false if there is no
    /// such guest.
    pub fn opt_in(&mut self, id: VmId) -> bool {
        let Some(v) = self.vms.get_mut(&id) else {
            return false;
        };
        v.opted_out = false;
        v.books.opted_out = false;
        v.scanned_this_pass = false;
        tracing::info!(vm = %id, name = %v.name, "opted in again by the operator");
        true
    }

    fn count_answer(&mut self, id: VmId, o: Outcome, stash: bool) {
        if let Some(v) = self.vms.get_mut(&id) {
            let b = &mut v.books;
            match (o, stash) {
                (Outcome::Changed, false) => b.share_changed += 1,
                (Outcome::Refused, false) => b.share_refused += 1,
                (Outcome::Changed, true) => b.stash_changed += 1,
                (Outcome::Refused, true) => b.stash_refused += 1,
                _ => {}
            }
        }
    }

    fn share_outcome(&mut self, id: VmId, g: Gfn, f: FrameId, o: Outcome) {
        self.count_answer(id, o, false);
        let mapped = o == Outcome::Done;
        if o == Outcome::Refused {
            let now = self.now_us();
            self.vms
                .get_mut(&id)
                .expect("outcome() checked")
                .share_refused_us = Some(now);
        }
        let d = self.dom(id);
        let zero = self.domain(d).zero_frames.contains(&f);
        let v = self.vms.get_mut(&id).expect("outcome() checked");
        if v.state(g) != PageState::Sharing(f) {
            debug_assert!(
                false,
                "{id} {g}: share answer for a page in {:?}",
                v.state(g)
            );
            return;
        }
        if mapped {
            v.set(g, PageState::Shared(f));
            v.books.shared_pages += 1;
            v.books.shares += 1;
            if zero {
                v.books.zero_shared_pages += 1;
            }
        } else {
            v.set(g, PageState::Private);
        }
        self.read_share_answered(id, g, mapped);
        self.landed_share_answered(id, g, mapped.then_some(f));
        self.frame_answer(d, f, mapped);
    }

    fn reclaim_outcome(&mut self, id: VmId, g: Gfn, o: Outcome) {
        self.count_answer(id, o, false);
        if self.punched_outcome(id, g, o, false) {
            self.vms.get_mut(&id).expect("checked").books.reclaims += 1;
        }
    }

    /// The answer to a punch of guest `id`'s page `g` (a zero-page reclaim or a free-page
    /// discard, state `Reclaiming`): done, a reclaimed zero page (booked as a free page's
    /// hole when `free`); else private again. Returns whether it was punched.
    pub(crate) fn punched_outcome(&mut self, id: VmId, g: Gfn, o: Outcome, free: bool) -> bool {
        let v = self.vms.get_mut(&id).expect("outcome() checked");
        if v.state(g) != PageState::Reclaiming {
            return false;
        }
        if o == Outcome::Done {
            if free {
                v.set_free_hole(g);
            } else {
                v.set(g, PageState::Zero);
                v.books.zero_reclaimed_pages += 1;
            }
            true
        } else {
            v.set(g, PageState::Private);
            false
        }
    }

    fn stash_outcome(&mut self, id: VmId, g: Gfn, b: BlobId, o: Outcome) {
        self.count_answer(id, o, true);
        let kept = self.blobs.get(b).kept();
        let reference = self.blobs.get(b).reference();
        let now = self.now_us();
        let v = self.vms.get_mut(&id).expect("outcome() checked");
        if v.state(g) != PageState::Stashing(b) {
            debug_assert!(
                false,
                "{id} {g}: stash answer for a page in {:?}",
                v.state(g)
            );
            return;
        }
        if o == Outcome::Done && kept == Kept::Unmapped {
            // The identical patch has done its work (the agent compared the page with the
            // frame under write-protection and punched it): the P2M entry now names the
            // frame and takes over the blob's patch reference; the record goes.
            let f = reference.expect("an identical blob has a reference frame");
            let d = v.domain;
            v.set(g, PageState::Unmapped(f));
            v.unmapped_ages.mark(&mut v.clock, g, now);
            *v.books.kept_pages(kept) += 1;
            v.books.unmapped_shares += 1;
            self.domain_mut(d).frames.incref(f, true);
            self.release_blob(b);
            return;
        }
        if o == Outcome::Done {
            v.set(g, PageState::Stored(b));
            *v.books.kept_pages(kept) += 1;
            *match kept {
                Kept::Patched => &mut v.books.patches,
                Kept::Compressed => &mut v.books.compressions,
                Kept::Swapped => &mut v.books.swap_outs,
                Kept::Unmapped => &mut v.books.unmapped_shares,
            } += 1;
            return;
        }
        v.set(g, PageState::Private);
        self.release_blob(b);
    }

    /// A move of a stored page's blob to the swap file: done only if the agent still had
    /// the page stored and both blobs decode alike.
    fn move_outcome(&mut self, id: VmId, g: Gfn, b: BlobId, o: Outcome) {
        self.count_answer(id, o, true);
        if self.orphans.remove(&b) {
            // The guest took the page back meanwhile (its old blob went then).
            self.release_blob(b);
            return;
        }
        let old = self.blobs.take_replaces(b);
        let state = self.vms[&id].state(g);
        let (PageState::Moving(_), Some(old)) = (state, old) else {
            debug_assert!(false, "{id} {g}: move answer for a page in {state:?}");
            return;
        };
        debug_assert_eq!(state, PageState::Moving(b));
        let old_kept = self.blobs.get(old).kept();
        let v = self.vms.get_mut(&id).expect("outcome() checked");
        if o == Outcome::Done {
            v.set(g, PageState::Stored(b));
            *v.books.kept_pages(old_kept) -= 1;
            *v.books.kept_pages(Kept::Swapped) += 1;
            v.books.swap_outs += 1;
            v.books.swap_moves += 1;
            self.release_blob(old);
        } else {
            v.set(g, PageState::Stored(old));
            self.release_blob(b);
        }
    }

    /// The agent broke copy-on-write on page `g`, which left frame `f`: the page is
    /// private again (C1 until its next clock scan).
    pub fn cow_broken(&mut self, id: VmId, g: Gfn, f: FrameId) {
        if self.park_early(id, g, Early::CowBroken(f)) {
            return;
        }
        // memfoldd asked for this break, to share the page without a mapping.
        let asked = self
            .vms
            .get_mut(&id)
            .is_some_and(|v| v.unmapping.remove(&g));
        if asked && self.unmap_broken(id, g, f) {
            return;
        }
        if self.take_shared(id, g, f) {
            self.vms.get_mut(&id).expect("checked").books.cow_breaks += 1;
            self.read_share_undone(id, g);
        }
    }

    /// Page `g`, shared onto frame `f`, is private again (C1 until its next clock scan):
    /// the frame's reference is released, and the page is no longer being unmapped
    /// (`unmapped.rs`; a take-back's answer keeps it there until the page leaves the
    /// frame, however it leaves: a CoW break, a discard). Returns false (nothing changed)
    /// if the page is not shared onto `f`.
    pub(crate) fn take_shared(&mut self, id: VmId, g: Gfn, f: FrameId) -> bool {
        let Some(v) = self.vms.get_mut(&id).filter(|v| g.0 < v.pages()) else {
            return false;
        };
        if v.state(g) != PageState::Shared(f) {
            return false;
        }
        let d = v.domain;
        // Left in, its next CoW break, shared again, would pass for one memfoldd asked.
        v.unmapping.remove(&g);
        v.set(g, PageState::Private);
        v.clock.fresh(g.0);
        v.books.shared_pages -= 1;
        let zero = self
            .domains
            .get(&d)
            .is_some_and(|dom| dom.zero_frames.contains(&f));
        if zero {
            let v = self.vms.get_mut(&id).expect("checked");
            v.books.zero_shared_pages = v.books.zero_shared_pages.saturating_sub(1);
        }
        self.frame_decref(d, f, false);
        true
    }

    /// The guest touched reclaimed zero page `g` and the agent filled it.
    pub fn refilled(&mut self, id: VmId, g: Gfn) {
        if self.park_early(id, g, Early::Refilled) {
            return;
        }
        if self.take_zero(id, g) {
            self.vms.get_mut(&id).expect("checked").books.refills += 1;
        }
    }

    /// Reclaimed zero page `g` is private again. Returns false if it was not reclaimed.
    fn take_zero(&mut self, id: VmId, g: Gfn) -> bool {
        let Some(v) = self.vms.get_mut(&id).filter(|v| g.0 < v.pages()) else {
            return false;
        };
        if v.state(g) != PageState::Zero {
            return false;
        }
        if v.is_free_hole(g) {
            v.books.free_reclaimed_pages -= 1;
        }
        v.set(g, PageState::Private);
        v.clock.fresh(g.0);
        v.books.zero_reclaimed_pages -= 1;
        true
    }

    /// The guest touched stored page `g` and the agent decoded it back (or, for a page
    /// shared without a mapping, copied its frame in).
    pub fn unstashed(&mut self, id: VmId, g: Gfn) {
        if self.park_early(id, g, Early::Unstashed) {
            return;
        }
        if let Some(lived_long) = self.take_unmapped(id, g) {
            // No blob, so no lifetime to record: only whether it lived long
            // ([`super::unmapped::UnmappedAges`]).
            let v = self.vms.get_mut(&id).expect("take_unmapped checked");
            v.hints.restash_after(g, lived_long);
            v.books.unstashes += 1;
            return;
        }
        let Some(blob) = self.take_stored(id, g) else {
            return;
        };
        let lived = self.now_us().saturating_sub(blob.since_us());
        self.restash_after(id, g, lived);
        let v = self.vms.get_mut(&id).expect("take_stored checked");
        v.books.unstashes += 1;
        if blob.kept() == Kept::Swapped {
            v.books.swap_ins += 1;
        }
        self.books.lifetimes.record(lived);
    }

    /// Page `g`, shared without a mapping, is private again: the frame's patch reference
    /// is released and the unmapped count lowered. Returns whether it had lived out
    /// [`super::RESTASH_LIVED_US`] unmapped; `None` if the page is not unmapped.
    pub(crate) fn take_unmapped(&mut self, id: VmId, g: Gfn) -> Option<bool> {
        let now = self.now_us();
        let v = self.vms.get_mut(&id).filter(|v| g.0 < v.pages())?;
        let PageState::Unmapped(f) = v.state(g) else {
            return None;
        };
        let d = v.domain;
        v.set(g, PageState::Private);
        v.clock.fresh(g.0);
        *v.books.kept_pages(Kept::Unmapped) -= 1;
        let lived_long = v.unmapped_ages.take(&mut v.clock, g, now);
        self.frame_decref(d, f, true);
        Some(lived_long)
    }

    /// Stored (or moving) page `g` is private again: its blob is released (a move's new
    /// blob is orphaned, for the move's answer to release) and its kind's count lowered.
    /// Returns the released blob's record; `None` if the page is not stored.
    pub(crate) fn take_stored(&mut self, id: VmId, g: Gfn) -> Option<crate::blobs::Blob> {
        let v = self.vms.get(&id).filter(|v| g.0 < v.pages())?;
        let b = match v.state(g) {
            PageState::Stored(b) => b,
            // Its move's answer releases the new blob.
            PageState::Moving(new) => self.blobs.replaces(new)?,
            _ => return None,
        };
        if let PageState::Moving(new) = v.state(g) {
            self.blobs.take_replaces(new);
            self.orphans.insert(new);
        }
        let blob = *self.blobs.get(b);
        let v = self.vms.get_mut(&id).expect("checked");
        v.set(g, PageState::Private);
        v.clock.fresh(g.0);
        *v.books.kept_pages(blob.kept()) -= 1;
        self.release_blob(b);
        Some(blob)
    }
}
