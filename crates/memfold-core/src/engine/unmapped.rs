//! Sharing without a mapping (issue 19, "no VMA wall"). A page the sharing scan finds
//! identical to a pool frame (ESX §4.3) is normally mapped onto it, and each run of such
//! mappings is a VMA in QEMU, bounded by `vm.max_map_count`. A *cold* identical page —
//! one the NRU clock (DE §4.2) last found in a class the policy patches or compresses —
//! or any identical page of a guest whose agent lately refused a share (its VMA budget)
//! is instead stashed as DE §3.2's degenerate patch: an empty patch that decodes to the
//! frame's bytes, so that the agent compares the page with the frame under
//! write-protection before it punches the page out of guest RAM. Once it has, the page is
//! [`PageState::Unmapped`]: its P2M entry names the frame and holds a patch reference on
//! it, so that the frame is neither freed nor reused while the page depends on it; the
//! blob record goes (and the agent keeps no stash record either), so such a page costs
//! no more metadata than a mapped one (issue 19: the two records were 72 bytes a page,
//! 0.2% of an 8 GiB guest). No VMA is spent; the saving is booked as sharing
//! ([`Kept::Unmapped`]).
//!
//! The page comes back private on its next access (the agent's missing fault copies the
//! frame in: the bytes it was found equal to, in a frame no guest can write). A page taken back
//! soon waits DE's re-store back-off (`PageHints::restash_wait`: 2, 4, then 7 idle clock
//! scans) before it is kept unmapped again; meanwhile the scan maps it, so hot identical
//! pages stay mapped and none cycles through stash and decode.
//!
//! A page the scan mapped before the clock found it cold, or before the agent ran out of
//! VMAs, stays charged to QEMU's VMA budget while it is shared. Under VMA pressure the
//! clock's slices turn such pages into shares without a mapping ([`Engine::unmap_shared`]):
//! memfoldd asks each back as the operator's opt-out does ([`Command::TakeBack`]; the agent
//! breaks copy-on-write, which maps guest RAM back over the page), and when the break is
//! reported keeps the page as its identical patch at once ([`Engine::unmap_broken`]). So
//! the frames stay mapped only for pages read while shared: those come back private on
//! their first read, and their re-store back-off keeps them mapped from then on.
//!
//! [`Kept::Unmapped`]: crate::blobs::Kept::Unmapped

use memfold_codecs::{page_checksum, Encoding, PatchCodec};

use super::{Command, Engine};
use crate::blobs::{BlobHome, Form, Kept};
use crate::ids::{DomainId, FrameId, Gfn, VmId};
use crate::p2m::PageState;
use crate::{Page, PAGE_SIZE};

/// For this long after the agent refused a share (µs), every identical page of its guest
/// is shared without a mapping: the refusal most likely was its VMA budget.
pub(crate) const VMA_PRESSURE_US: u64 = 30_000_000;

/// Most mapped shared pages one clock slice asks back under VMA pressure
/// ([`Engine::unmap_shared`]): each is a CoW break and a stash in the agent (tens of µs
/// each), which its thread does between guest faults.
pub(crate) const UNMAP_PER_SLICE: u32 = 4096;

/// The patch of a page identical to its reference, in the run-diff encoding (DE §3.2):
/// no record at all — 0 bytes, decoded by the agent's existing patch path into the
/// reference itself, and kept in no store slot (`slab::EMPTY`): a page shared without a
/// mapping costs the store nothing (it cost a 64-byte slot for a 3-byte patch before).
pub(crate) const IDENTICAL_PATCH: [u8; 0] = [];

/// What becomes of a page found identical to a frame or another page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Identical {
    /// Mapped onto the frame (ESX §4.3).
    Map,
    /// Shared without a mapping: stashed as the identical patch of the frame, then
    /// [`PageState::Unmapped`].
    Unmapped,
    /// Left private for now: cold by a class the clock found before the page was last
    /// read, so its next clock slice decides ([`Engine::share_cold`]).
    Defer,
}

/// Who found a page identical ([`Engine::match_identical`]): what its class is worth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Seen {
    /// The sharing scan, up to a clock interval after the page's class was found.
    Scan,
    /// The clock's slice, which classified the page just now.
    Clock,
    /// A disk read that just filled the page (Satori §4.1). Its class is C2 now
    /// (`ClockHand::landed`): mapped, like any page in use; its hinted twin, if cold, is
    /// shared without a mapping as the clock's would be.
    Read,
}

/// What the share table gave a page ([`Engine::match_identical`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Found {
    /// Shared (a request queued: a share or a stash).
    Acted,
    /// Identical, but nothing done now (left for the clock, or no frame to be had).
    Deferred,
    /// Only the page's own hint.
    Hinted,
    /// Nothing equal.
    Nothing,
}

mod ages;
pub(crate) use ages::UnmappedAges;

impl Engine {
    /// Whether the agent of guest `id` refused a share in the last [`VMA_PRESSURE_US`].
    pub(crate) fn vma_pressure(&self, id: VmId) -> bool {
        let now = self.now_us();
        self.vms
            .get(&id)
            .and_then(|v| v.share_refused_us)
            .is_some_and(|t| now.saturating_sub(t) < VMA_PRESSURE_US)
    }

    /// What becomes of page `g` of guest `id`, found identical to a pool frame or another
    /// page (`zero`: all zeros; `seen`: who found it). Mapped unless
    /// the knob is on, the page is not zero and has waited out its re-store back-off, and
    /// either the guest's agent refuses shares (then it is shared without a mapping) or
    /// the clock's last scan found it in a class the policy patches or compresses (cold:
    /// C3/C4 under `de`). A cold page is shared without a mapping only when its class is
    /// fresh: the sharing scan, which reads pages up to a clock interval after their
    /// class was found, leaves it to the clock's next slice ([`Identical::Defer`]), so a
    /// page written since (and likely to be used) is not stashed on a stale class.
    ///
    /// Under VMA pressure a page that would be mapped is left for later instead
    /// ([`Identical::Defer`]): its share would only be refused again. Asked anyway, a
    /// guest at its budget refused 33 000–54 000 shares a second (a 2–4 GiB `tiny` guest,
    /// 5–8 million in 150 s), each a request, a reply and the agent's check.
    pub(crate) fn identical_action(&self, id: VmId, g: Gfn, zero: bool, seen: Seen) -> Identical {
        let pressure = self.vma_pressure(id);
        let map = if pressure {
            Identical::Defer
        } else {
            Identical::Map
        };
        if zero || !self.cfg.share_cold_unmapped {
            return map;
        }
        let Some(v) = self.vms.get(&id) else {
            return map;
        };
        let clock = v.clock.page(g.0);
        if clock.idle_scans() < v.hints.restash_wait(g).max(v.wait.floor) {
            return map; // taken back soon after it was last stored, or over its wait target
        }
        if pressure {
            return Identical::Unmapped;
        }
        let cold = self.cfg.clock_interval_us.is_some() && {
            let a = self.cfg.policy.for_state(clock.last_state());
            a.patch || a.compress
        };
        match (cold, seen) {
            (false, _) => Identical::Map,
            (true, Seen::Clock) => Identical::Unmapped,
            (true, _) => Identical::Defer,
        }
    }

    /// The clock's slice found private page `g` of guest `id` (holding `page`) cold: if it
    /// is identical to a frame or a hinted page, it is shared now (without a mapping,
    /// [`Engine::identical_action`]). Returns whether it was.
    pub(crate) fn share_cold(&mut self, id: VmId, g: Gfn, page: &Page) -> bool {
        if !self.cfg.share_cold_unmapped || !self.class_allows_share(id, g) {
            return false;
        }
        let h = (self.cfg.page_hash)(page);
        self.match_identical(id, g, page, h, false, Seen::Clock) == Found::Acted
    }

    /// Shares private page `g` of guest `id` (holding `page`, equal to frame `f`'s bytes)
    /// without a mapping: writes its identical patch to the guest's store, takes a patch
    /// reference on `f`, and queues the stash. Returns false (nothing changed) if the
    /// store cannot take the blob: the caller maps the page then.
    pub(crate) fn share_unmapped(&mut self, id: VmId, g: Gfn, f: FrameId, page: &Page) -> bool {
        let blob = IDENTICAL_PATCH;
        let Some(slot) = self.put_blob(id, &blob, BlobHome::Store) else {
            return false;
        };
        let d = self.dom(id);
        self.domain_mut(d).frames.incref(f, true);
        self.vms.get_mut(&id).expect("sharable").hints.age_reset(g);
        self.queue_stash(
            id,
            g,
            slot,
            blob.len(),
            Form::Encoded(Encoding::Patch(PatchCodec::RunDiff)),
            Some(f),
            BlobHome::Store,
            None,
            page_checksum(page),
            true,
        );
        true
    }

    /// Under VMA pressure ([`Engine::vma_pressure`]), asks back the pages of clock slice
    /// `[first, end)` of guest `id` that are mapped onto pool frames, at most
    /// [`UNMAP_PER_SLICE`], to share them without a mapping once their CoW break is
    /// reported ([`Engine::unmap_broken`]). Pages taken back soon after they were last kept
    /// unmapped (read while shared: their re-store back-off not waited out) stay mapped.
    /// Nothing happens with `share_cold_unmapped` off or for a guest opted out.
    ///
    /// Why ask back instead of refusing new shares: the agent charges every page on a
    /// frame to its VMA budget (`M + F + R ≤ max_map_count − 4096`: a CoW break cannot be
    /// refused), so the pages mapped first would hold the budget for good; a 2–4 GiB
    /// `tiny` guest stopped sharing at ~57 000 mapped pages (docs/scale.md).
    pub(crate) fn unmap_shared(&mut self, id: VmId, first: Gfn, end: Gfn) {
        if !self.cfg.share_cold_unmapped || !self.vma_pressure(id) {
            return;
        }
        let Some(v) = self.vms.get_mut(&id).filter(|v| v.attached && !v.opted_out) else {
            return;
        };
        let end = end.0.min(v.pages());
        let mut asked = 0;
        for i in first.0..end {
            let g = Gfn(i);
            if asked == UNMAP_PER_SLICE {
                break;
            }
            if !matches!(v.state(g), PageState::Shared(_))
                || v.unmapping.contains(&g)
                || v.clock.page(i).idle_scans() < v.hints.restash_wait(g)
            {
                continue;
            }
            v.unmapping.insert(g);
            v.queue.push(Command::TakeBack { gfn: g });
            asked += 1;
        }
    }

    /// Page `g` of guest `id`, asked back by [`Engine::unmap_shared`], left frame `f` in
    /// the agent's CoW break: it is shared without a mapping now, as the identical patch
    /// of `f`'s bytes (the stash's check finds it changed if the guest wrote it since).
    /// Returns false, nothing changed, if the page is not shared onto `f`, its guest is
    /// opted out, or the frame cannot be read: the caller books a plain CoW break (booked
    /// here if the page was taken off the frame but its blob could not be stored).
    ///
    /// Invariant: the frame stays held throughout (an extra reference until the blob's
    /// patch reference holds it), so it is never freed or reused between the mapping's
    /// release and the blob's, which decodes against it.
    pub(crate) fn unmap_broken(&mut self, id: VmId, g: Gfn, f: FrameId) -> bool {
        let Some(v) = self.vms.get(&id) else {
            return false;
        };
        if v.opted_out || g.0 >= v.pages() || v.state(g) != PageState::Shared(f) {
            return false;
        }
        // A free discard of it under way: the break leaves it private, as its answer must
        // find it, no stash queued (the invariant of `Vm::request_going`).
        if v.free_watch.held.contains(&g) {
            return false;
        }
        let d = v.domain;
        // A never-share page, or a frame one held, is not shared again (never_share.rs).
        if self.never_share(id, g) || self.withdrawn(d, f) {
            return false;
        }
        let mut page = [0u8; PAGE_SIZE];
        if self.domain(d).pool.read(f.offset(), &mut page).is_err() {
            return false;
        }
        self.domain_mut(d).frames.incref(f, false);
        let taken = self.take_shared(id, g, f);
        debug_assert!(taken, "checked Shared({f}) above");
        if self.share_unmapped(id, g, f, &page) {
            self.vms.get_mut(&id).expect("checked").books.unmaps += 1;
        } else {
            // Left private (no store slot; not today: the identical patch is empty): booked
            // as the plain CoW break `cow_broken` books when this returns false.
            self.vms.get_mut(&id).expect("checked").books.cow_breaks += 1;
            self.read_share_undone(id, g);
        }
        self.frame_decref(d, f, false);
        true
    }

    /// Frames held only as patch references of which at least one is held by a page
    /// shared without a mapping (or its identical patch, in flight): sharing's frames in
    /// the books, not patching's. One pass over every guest's P2M (O(guest pages), a
    /// millisecond or two for 8 GiB of guests), when the books are read.
    pub(crate) fn unmapped_reference_frames(&self) -> u64 {
        // A bit a frame of each domain (a 2.5 M-frame pool: 320 KiB), not a hash set of
        // up to one entry a page: this runs at every read of the books (each second).
        let mut seen: std::collections::BTreeMap<DomainId, Vec<u64>> = self
            .domains
            .iter()
            .map(|(&d, dom)| (d, vec![0u64; (dom.frames.size() as usize).div_ceil(64)]))
            .collect();
        let mut count = 0u64;
        let mut note = |d: DomainId, f: FrameId| {
            let frames_of = &self.domain(d).frames;
            let Some(bits) = seen.get_mut(&d) else {
                return;
            };
            let (w, bit) = (f.0 as usize / 64, 1u64 << (f.0 % 64));
            if w < bits.len()
                && bits[w] & bit == 0
                && frames_of.patch_refs(f) == frames_of.refcount(f)
            {
                bits[w] |= bit;
                count += 1;
            }
        };
        for (_, b) in self.blobs.iter() {
            let Some(f) = b.reference().filter(|_| b.kept() == Kept::Unmapped) else {
                continue;
            };
            if let Some(v) = self.vms.get(&b.vm) {
                note(v.domain, f);
            }
        }
        for v in self.vms.values() {
            for e in &v.p2m {
                if let PageState::Unmapped(f) = e.state() {
                    note(v.domain, f);
                }
            }
        }
        count
    }
}

#[cfg(test)]
mod tests;
