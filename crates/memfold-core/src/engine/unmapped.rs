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
    /// opted out, or the frame cannot be read: the caller books a plain CoW break.
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
mod tests {
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
}
