//! Pages an enlightened guest marks never to be shared (Satori §4.3, "What if sharing is
//! broken?"; issue 17): a write to a shared page is a CoW break, tens of µs slower than a
//! plain write, so a guest that builds a copy of a page it guesses another guest holds
//! can time its write and learn whether the other guest holds it. A guest protects a
//! process's or a file's pages by marking them (`memfold-guest never-share --pid/--path`;
//! the never-share bit of its category report, [`crate::categories::PageInfo`]).
//!
//! The invariant, kept here and at each place a page could join a frame: *a page marked
//! in its guest's last report is never shared, patched, or a reference page, and one that
//! was when the report came is taken back*:
//! - the sharing scan neither shares a marked page nor leaves its hint (`scan.rs`,
//!   `consider_seen`, `match_identical`, and the hint it would pair with); shares at read
//!   and fills skip it (`at_read.rs`, `fill.rs`);
//! - the Difference Engine neither patches it nor takes it as a reference page (`de.rs`);
//!   it may compress or swap it (no other guest's page is involved), and a zero page is
//!   still reclaimed (its refill tells a guest only about its own page);
//! - on each report, `Engine::take_back_never_share` takes back every marked page that
//!   is mapped onto a frame, stored against one (a patch), or shared without a mapping
//!   onto one, and *withdraws* the frame (`Domain::withdrawn`): it leaves the share table
//!   (its bytes are the marked page's; a new page equal to them must not find it), is no
//!   reference for a new patch (`de.rs`, `candidate`), no fill (`fill.rs`), no target of
//!   a share without a mapping (`unmapped.rs`, `unmap_broken`), and every other page on
//!   it is taken back too (left alone on it, a partner's next write would still be a CoW
//!   break) — at most [`MAX_PARTNER_TAKEBACKS`] pages every [`PARTNER_PASS_US`] for the
//!   domain, so that toggling marks cannot make memfoldd copy other guests' pages back
//!   without end, nor walk the domain's pages at every guest's report. A withdrawn frame is forgotten when freed.
//! - a request under way at the report (a share, a fill, a stash, a move: on no frame
//!   yet) that lands a marked page on a frame, or any page on a withdrawn frame, is
//!   taken back as it lands, its frame withdrawn (`Engine::never_share_landed`, from
//!   every answer in `outcomes.rs`); left, the page stayed shared until the next report.
//!
//! What it cannot do: a page is marked from the guest's next report on (memfoldd asks
//! every `--guest-interval-ms`, 3 s by default); in between, a new page of a marked
//! process or file may be shared and its write timed, and a partner on a withdrawn frame
//! keeps it until the next pass. A whole guest marked never-share (`--never-share`,
//! docs/side-channel.md) has no such window.

use super::Engine;
use crate::ids::{DomainId, FrameId, Gfn, VmId};
use crate::p2m::PageState;
use crate::share::ShareEntry;

use super::Command;

impl Engine {
    /// Whether guest `id`'s last report marked page `g` never to be shared.
    pub(crate) fn never_share(&self, id: VmId, g: Gfn) -> bool {
        self.vms
            .get(&id)
            .and_then(|v| v.categories.as_ref())
            .is_some_and(|m| m.never_share(g))
    }

    /// Takes back into guest RAM every page of guest `id` its last report marked never to
    /// be shared and that is shared now: mapped onto a frame, stored against one (a
    /// patch), or shared without a mapping onto one. Each such frame is *withdrawn* (not the
    /// zero frame: zeros are no secret): out of the share table, no reference for a new
    /// patch, no fill, and every page on it, of any guest of the domain, is taken back
    /// until the frame is freed. Returns the pages asked to be taken back.
    ///
    /// Why the partners too: a page that shared a frame with the marked one stays on it
    /// alone otherwise, and its guest's next write is still a CoW break — the timing
    /// that tells it the marked page was there. Taken back, it writes as a private page.
    /// They pair again on later scans, on a new frame, without the marked page.
    ///
    /// Bounded against a guest that toggles its marks to make memfoldd copy other guests'
    /// pages back over and over: the pass over the domain's guests runs at most every
    /// [`PARTNER_PASS_US`] for the domain, whichever guest's report starts it (and at once
    /// for a report that withdraws a frame, at most every [`PARTNER_PASS_US`] for its
    /// guest), and takes back at most [`MAX_PARTNER_TAKEBACKS`] pages of other guests; the
    /// rest wait for the next pass.
    /// All are booked to the marking guest (`never_share_takebacks`).
    ///
    /// A page with a request under way is taken back when the request lands
    /// ([`Engine::never_share_landed`]), marked or a partner; a marked one's reference
    /// frame (a patch being stored or moved) is withdrawn at once all the same, for an
    /// answer lost never lands.
    pub(crate) fn take_back_never_share(&mut self, id: VmId) -> u32 {
        let Some(v) = self.vms.get(&id) else {
            return 0;
        };
        let Some(map) = v.categories.as_ref() else {
            return 0;
        };
        let mut new_frames: Vec<FrameId> = Vec::new();
        let mut own: Vec<Gfn> = Vec::new();
        for g in map.never_share_pages() {
            let s = v.state(g);
            if let Some(f) = self.sharing_frame(v.domain, s) {
                new_frames.push(f);
                // In flight: its take-back is queued when it lands (once, not twice).
                if !in_flight(s) {
                    own.push(g);
                }
            }
        }
        self.take_back_marked(id, &own, new_frames)
    }

    /// At guest `id`'s (re-)attach: its own pages still on withdrawn frames — partners
    /// whose take-backs ended with the old connection — asked again at once, not at the
    /// domain's next pass (up to [`PARTNER_PASS_US`] later). One walk over its own P2M,
    /// as the attach's reconcile makes. Returns the pages queued.
    pub(crate) fn retake_own_partners(&mut self, id: VmId) -> u32 {
        let Some(v) = self.vms.get(&id) else {
            return 0;
        };
        let withdrawn = &self.domain(v.domain).withdrawn;
        if withdrawn.is_empty() {
            return 0;
        }
        let on: Vec<Gfn> = (0..v.pages())
            .map(Gfn)
            .filter(|&g| {
                self.sharing_frame(v.domain, v.state(g))
                    .is_some_and(|f| withdrawn.contains(&f))
            })
            .collect();
        let n = self.queue_take_backs(id, &on);
        if let Some(v) = self.vms.get_mut(&id) {
            v.books.never_share_takebacks += n as u64;
        }
        n
    }

    /// Guest `id`'s page `g`, whose request was under way (a share, a fill, a stash, a
    /// move), landed on a frame: mapped onto it, shared without a mapping, or stored
    /// against it. Marked in its guest's report meanwhile, it is taken back and its frame
    /// withdrawn at once, as [`Engine::take_back_never_share`] does (the report found no
    /// frame to withdraw: the page was not on it yet); else, on a frame withdrawn while
    /// its request was under way, it is a partner the pass passed over (it skips pages in
    /// flight), taken back now — booked to its own guest, the marking one unknown here.
    /// Only requests sent before a withdrawal land on the frame (it is no share target,
    /// reference or fill after), so the partners taken back so are few and not capped.
    /// Returns the pages queued.
    pub(crate) fn never_share_landed(&mut self, id: VmId, g: Gfn) -> u32 {
        let Some(v) = self.vms.get(&id).filter(|v| g.0 < v.pages()) else {
            return 0;
        };
        let d = v.domain;
        let Some(f) = self.sharing_frame(d, v.state(g)) else {
            return 0;
        };
        if self.never_share(id, g) {
            return self.take_back_marked(id, &[g], vec![f]);
        }
        if !self.withdrawn(d, f) {
            return 0;
        }
        let n = self.queue_take_backs(id, &[g]);
        let v = self.vms.get_mut(&id).expect("looked up");
        v.books.never_share_takebacks += n as u64;
        n
    }

    /// The frame a page in state `s` of domain `d` shares with others (not the zero
    /// frame: zeros are no secret): the one it is mapped onto, shared without a mapping
    /// onto, or stored against (a patch) — also while that store or its move to swap is
    /// under way: an answer lost never lands ([`Engine::never_share_landed`]), and the
    /// re-attach makes the page private, so the report is the last to see its frame.
    fn sharing_frame(&self, d: DomainId, s: PageState) -> Option<FrameId> {
        let f = match s {
            PageState::Shared(f) | PageState::Unmapped(f) => Some(f),
            PageState::Stored(b) | PageState::Stashing(b) | PageState::Moving(b) => {
                self.blobs.get(b).reference()
            }
            _ => None,
        };
        f.filter(|f| !self.domain(d).zero_frames.contains(f))
    }

    /// Takes back marked pages `own` of guest `id` and withdraws `new_frames`, the frames
    /// they are on; then, when due, the pass over the domain's pages on withdrawn frames
    /// ([`Engine::take_back_never_share`]). Returns the pages asked to be taken back.
    fn take_back_marked(&mut self, id: VmId, own: &[Gfn], new_frames: Vec<FrameId>) -> u32 {
        let d = self.dom(id);
        let dom = self.domain_mut(d);
        let mut withdrew = false;
        for f in new_frames {
            if dom.withdrawn.insert(f) {
                withdrew = true;
                dom.share.remove(dom.frames.hash(f), ShareEntry::Shared(f));
                // No reference any more: its buckets go to pages that may be.
                dom.similar.forget_frame(f);
            }
        }
        let mut total = self.queue_take_backs(id, own);
        let now = self.now_us();
        let due = |t: Option<u64>| t.is_none_or(|t| now.saturating_sub(t) >= PARTNER_PASS_US);
        // The domain's pass every PARTNER_PASS_US, whichever guest reports (a timer a
        // guest let each guest's report walk every guest's pages); and at once for a
        // report that withdrew a frame, once each PARTNER_PASS_US for its guest, so that
        // another guest's recent pass does not leave a new mark's partners exposed.
        let vm_due = withdrew && due(self.vms[&id].never_share_pass_us);
        if (vm_due || due(self.domain(d).partner_pass_us)) && !self.domain(d).withdrawn.is_empty() {
            self.domain_mut(d).partner_pass_us = Some(now);
            if vm_due {
                self.vms
                    .get_mut(&id)
                    .expect("looked up")
                    .never_share_pass_us = Some(now);
            }
            // Every page on a withdrawn frame: no reverse map, so one pass over the
            // domain's P2Ms. Pages whose take-back is queued already are passed over, so
            // that they do not fill the pass's cap again.
            let withdrawn = &self.domain(d).withdrawn;
            let mut partners: Vec<(VmId, Gfn)> = Vec::new();
            'guests: for (&vid, v) in self.vms.iter().filter(|(_, v)| v.domain == d) {
                let queued = v.queued_take_backs();
                for g in (0..v.pages()).map(Gfn).filter(|g| !queued.contains(g)) {
                    // Pages in flight are passed over: each is taken back if it lands
                    // on the frame (`never_share_landed`).
                    let s = v.state(g);
                    let on = self.sharing_frame(d, s).filter(|_| !in_flight(s));
                    if on.is_some_and(|f| withdrawn.contains(&f)) {
                        if partners.len() >= MAX_PARTNER_TAKEBACKS {
                            break 'guests;
                        }
                        partners.push((vid, g));
                    }
                }
            }
            let mut by_vm: std::collections::BTreeMap<VmId, Vec<Gfn>> = Default::default();
            for (vid, g) in partners {
                by_vm.entry(vid).or_default().push(g);
            }
            for (vid, gfns) in by_vm {
                total += self.queue_take_backs(vid, &gfns);
            }
        }
        let v = self.vms.get_mut(&id).expect("looked up");
        v.books.never_share_takebacks += total as u64;
        if total > 0 {
            tracing::info!(vm = %id, name = %v.name, pages = total, "pages on frames of pages marked never-share taken back");
        }
        total
    }

    /// Queues a take-back of each of `gfns` of guest `vid` not already queued (an opted-out
    /// guest's pages are being taken back already), and drops them from the pages being
    /// unmapped (whose CoW break would share them again without a mapping). Returns how
    /// many it queued.
    fn queue_take_backs(&mut self, vid: VmId, gfns: &[Gfn]) -> u32 {
        let Some(v) = self.vms.get_mut(&vid).filter(|v| !v.opted_out) else {
            return 0;
        };
        let queued = v.queued_take_backs();
        let mut n = 0;
        for &g in gfns {
            v.unmapping.remove(&g);
            if !queued.contains(&g) {
                v.queue.push(Command::TakeBack { gfn: g });
                n += 1;
            }
        }
        n
    }

    /// Whether frame `f` of domain `d` held a page marked never-share and may not be
    /// joined: no reference for a patch, no fill, no share without a mapping.
    pub(crate) fn withdrawn(&self, d: DomainId, f: FrameId) -> bool {
        self.domain(d).withdrawn.contains(&f)
    }
}

/// Whether a page in state `s` has a store or move under way, whose landing takes it
/// back if it must be ([`Engine::never_share_landed`]).
fn in_flight(s: PageState) -> bool {
    matches!(s, PageState::Stashing(_) | PageState::Moving(_))
}

/// Least time between two passes over a domain's guests taking back the pages on its
/// withdrawn frames, µs.
pub const PARTNER_PASS_US: u64 = 10_000_000;

/// Most pages of other guests one pass takes back (16 MiB).
pub const MAX_PARTNER_TAKEBACKS: usize = 4096;

#[cfg(test)]
mod tests;
