//! The NRU clock over live guests and the Difference Engine over its slices (DE §4.2,
//! §4.3, §4.6): each classified slice's cold private pages are indexed as reference
//! candidates, patched against a similar page or compressed, their blob written to the
//! store, and the agent asked to stash them; over the host budget, C4 pages go to the
//! swap file in their smallest form, and stored blobs move there too.

use memfold_codecs::{page_checksum, Encoding};

use super::{kept_index, Command, CompressBacking, Engine, Stash, RESTASH_LIVED_US};
use crate::blobs::{Blob, BlobHome, Form, StoreError};
use crate::clock::{mask_bit, Actions};
use crate::ids::{DomainId, FrameId, Gfn, Gpn, VmId};
use crate::p2m::{BlobId, PageState};
use crate::share::ShareEntry;
use crate::similarity::RefPage;
use crate::slab::{slot_size, Slot, MAX_CHUNK_PAGES};
use crate::{is_zero_page, Page, PAGE_SIZE};

use super::scan::READ_PAGES;

/// The oldest report whose referenced and active bits the clock takes as R, µs
/// ([`crate::EngineConfig::clock_from_guest`]): 10 reports at memfoldd's default interval
/// (3 s). A guest whose agent stopped answering (dead, stuck, or no longer asked) would
/// otherwise be judged by what it said once; past this its pages are armed whole again
/// and R is the host's.
pub(crate) const GUEST_R_MAX_AGE_US: u64 = 30_000_000;

impl Engine {
    /// Queues each attached guest's next clock slice when it is due (a pass over a guest
    /// spread evenly over the clock interval).
    pub fn clock_step(&mut self) {
        let Some(interval) = self.cfg.clock_interval_us else {
            return;
        };
        let now = self.now_us();
        let from_guest = self.cfg.clock_from_guest && self.cfg.guest_categories;
        let swap_wanted = self.budget.swap_wanted > 0;
        for v in self.vms.values_mut().filter(|v| v.attached && !v.opted_out) {
            // A guest at the top of its store floor stores nothing new: its clock rests
            // (no R/M faults, its pages' classes as they were) unless swap needs classes.
            if v.wait.floor >= super::wait_target::STORE_FLOOR_MAX && !swap_wanted {
                continue;
            }
            if let Some((first, count)) = v.clock.due_slice(now, interval) {
                let arm = v.clock.arm_mask(first, count, self.cfg.clock_rearm_max);
                // An enlightened guest's LRU pages: write-protected only, R from its bits.
                let wp_only = match (v.fresh_categories(now), from_guest) {
                    (Some(map), true) => {
                        let mut m = guest_lru_mask(map, first, count);
                        m.iter_mut().zip(&arm).for_each(|(w, a)| *w &= a);
                        m.truncate(arm.len());
                        m
                    }
                    _ => Vec::new(),
                };
                // Kept until the slice's bits come back: R is the guest's for exactly the
                // pages armed for writes only (its categories may change meanwhile).
                v.clock_wp_only.retain(|(f, _)| *f != first);
                if wp_only.iter().any(|&w| w != 0) {
                    v.clock_wp_only.push((first, wp_only.clone()));
                }
                // A pass after each round of frame page-outs: shared pages' PTEs too.
                let zap_shared = v.zap_shared_slices > 0;
                v.zap_shared_slices = v.zap_shared_slices.saturating_sub(1);
                v.queue.push(Command::ClockScan {
                    first: Gfn(first),
                    count,
                    arm,
                    wp_only,
                    zap_shared,
                });
            }
        }
    }

    /// Applies a clock slice's R and M bits (bit k of word k/64 for page `first + k`),
    /// classifying each private page C1–C4 (DE §4.2), then runs the Difference Engine over
    /// the slice. Bits for pages past the guest's end are ignored.
    pub fn clock_bits(
        &mut self,
        id: VmId,
        first: Gfn,
        count: u32,
        referenced: &[u64],
        modified: &[u64],
    ) {
        let full_scans = self.scan.full_scans;
        let Some(v) = self.vms.get_mut(&id) else {
            return;
        };
        if first.0 >= v.pages() {
            return;
        }
        // Pages armed for writes only at this slice's visit were used if the guest's
        // kernel says referenced or active (their reads took no fault).
        let sent = v
            .clock_wp_only
            .iter()
            .position(|(f, _)| *f == first.0)
            .map(|i| v.clock_wp_only.swap_remove(i).1);
        let with_guest;
        let referenced = match (&v.categories, sent) {
            (Some(map), Some(wp_only)) => {
                let mut r = referenced.to_vec();
                r.resize(wp_only.len().max(r.len()), 0);
                for k in 0..count.min(v.pages() - first.0) {
                    let g = Gfn(first.0 + k);
                    if mask_bit(&wp_only, k) && (map.referenced(g) || map.active(g)) {
                        r[k as usize / 64] |= 1 << (k % 64);
                    }
                }
                with_guest = r;
                &with_guest[..]
            }
            _ => referenced,
        };
        let p2m = &v.p2m;
        v.clock
            .apply(first.0, count, referenced, modified, full_scans, |g| {
                p2m[g as usize].state() == PageState::Private
            });
        v.books.nru_pages = v.clock.last_pass;
        v.books.clock_passes = v.clock.passes;
        // A page seen written has new bytes: the sharing scan reads it in each of its next
        // scans again (not only every 8th, were it quiet), so that a full sharing cycle
        // has read what patching and compression take (DE §4.3).
        for k in 0..count.min(v.pages() - first.0) {
            if mask_bit(modified, k) {
                v.hints.age_reset(Gfn(first.0 + k));
            }
        }
        let end = Gfn((first.0 + count).min(v.pages()));
        self.difference_engine(id, first, end);
        self.unmap_shared(id, first, end);
    }

    fn acts(&self, a: Actions) -> bool {
        a.reference || a.patch || a.compress || (self.budget.swap_wanted > 0 && a.swap)
    }

    /// The Difference Engine over pages `[first, end)` of guest `id` (DE §4.2, §4.3): each
    /// private page whose class lets a mechanism touch it is read once (holes skipped);
    /// zero pages are left to the zero policy, identical ones to the sharing scan.
    fn difference_engine(&mut self, id: VmId, first: Gfn, end: Gfn) {
        let policy = self.cfg.policy;
        if !policy.actions.iter().any(|&a| self.acts(a)) {
            return;
        }
        let Some(v) = self.vms.get(&id).filter(|v| v.attached) else {
            return;
        };
        let d = v.domain;
        self.refresh_similarity_index(d);
        let v = &self.vms[&id];
        let candidate = |g: Gfn| {
            v.state(g) == PageState::Private
                && !v.paged_out_or_going(g)
                && self.acts(policy.for_state(v.clock.page(g.0).last_state()))
        };
        let todo = candidates_with_data(first, end, candidate, |a, b| v.ram.next_data_run(a, b));
        let mut buf = vec![0u8; READ_PAGES * PAGE_SIZE];
        let mut i = 0;
        while i < todo.len() {
            let mut j = i + 1;
            while j < todo.len() && todo[j].0 == todo[j - 1].0 + 1 && j - i < READ_PAGES {
                j += 1;
            }
            let (g0, n) = (todo[i], j - i);
            i = j;
            if self.vms[&id]
                .ram
                .read(g0, &mut buf[..n * PAGE_SIZE])
                .is_err()
            {
                continue;
            }
            for k in 0..n {
                let page: &Page = buf[k * PAGE_SIZE..(k + 1) * PAGE_SIZE]
                    .try_into()
                    .expect("a page");
                self.de_page(id, Gfn(g0.0 + k as u32), page);
            }
        }
        self.swap_stored(id, first, end);
    }

    /// Clears and resizes domain `d`'s similarity index once every four clock intervals
    /// (DE §4.3 clears it once per clock cycle: stale buckets would keep out new
    /// candidates), or as soon as a cycle has offered it more pages than it has buckets.
    /// The first cycle's table is the paper's (half a bucket a managed page); later ones
    /// are sized for [`crate::EngineConfig::similarity_per_offered`] pages a page the last
    /// cycle offered, at most that (issue 19: a guest whose pages are mostly shared,
    /// stored or hot offers few, and the paper's table cost 4 bytes a guest page whatever
    /// it held).
    fn refresh_similarity_index(&mut self, d: DomainId) {
        let every = self.cfg.clock_interval_us.unwrap_or(4_000_000) * 4;
        let pages: u64 = self
            .vms
            .values()
            .filter(|v| v.domain == d)
            .map(|v| v.pages() as u64)
            .sum();
        let now = self.now_us();
        let per_offered = self.cfg.similarity_per_offered as u64;
        let dom = self.domain_mut(d);
        let offered = dom.similar.offered() as u64;
        let first = dom.similar.cycles() == 0;
        let n = if first {
            pages
        } else {
            (per_offered * offered).min(pages)
        };
        // Cleared early only to grow: at its largest size a clear would only lose
        // candidates.
        if first
            || now.saturating_sub(dom.similar_cleared_us) > every
            || (offered > dom.similar.buckets() as u64 && dom.similar.would_grow(n))
        {
            // The reference frames still held are indexed again (DE §4.3), from the
            // signatures kept at their promotion: reading them would bring back into RAM
            // those the kernel holds (kernel_swap.rs). A frame withdrawn from sharing
            // (never_share.rs) is no reference, nor the zero frame.
            let (frames, withdrawn, zero) = (&dom.frames, &dom.withdrawn, &dom.zero_frames);
            dom.similar.retain_kept(|f| {
                frames.contains(f)
                    && frames.is_used(f)
                    && !withdrawn.contains(&f)
                    && !zero.contains(&f)
            });
            dom.similar.clear_for(n);
            dom.similar_cleared_us = now;
        }
    }

    /// One page of a clock slice. Over the host budget, a page whose class allows swap
    /// (C4) goes to the swap file in its smallest form: patch, compressed, or raw (§4.6).
    fn de_page(&mut self, id: VmId, g: Gfn, page: &Page) {
        if is_zero_page(page) || !self.sharable(id, g) {
            return;
        }
        let full_scans = self.scan.full_scans;
        let swap_wanted = self.budget.swap_wanted > 0;
        let v = self.vms.get_mut(&id).expect("sharable");
        let clock = v.clock.page(g.0);
        // The class this slice's scan just found (`state()` would read the cleared bits).
        let a = self.cfg.policy.for_state(clock.last_state());
        if clock.idle_scans() == 0 {
            v.hints.set_de_failed(g, false); // written since: worth another try
        }
        // Sharing goes first: nothing is stored before a full sharing cycle saw the page,
        // nor before it has been idle as long as its history asks.
        // The wait target's floor holds back stores, not swap over the host budget.
        let floor = if swap_wanted { 0 } else { v.wait.floor };
        let seen = v.clock.seen_by_sharing(g.0, full_scans)
            && clock.idle_scans() >= v.hints.restash_wait(g).max(floor);
        let untried = !v.hints.de_failed(g);
        let to_swap = seen && a.swap && swap_wanted;
        let home = if to_swap {
            BlobHome::Swap
        } else {
            BlobHome::Store
        };
        let gpn = Gpn(v.base.0 + g.0);
        let d = v.domain;
        // Free in its guest's fresh report: the free-page discard's, which keeps nothing
        // (free_discard.rs). Over the host budget, swap still may take it.
        if !to_swap && self.free_for_discard(id, g) {
            return;
        }
        // Cold and identical to a frame or a page: shared, without a mapping (issue 19).
        if (a.patch || a.compress) && self.share_cold(id, g, page) {
            return;
        }
        // A page its guest marked never-share is neither patched nor a reference
        // (never_share.rs); it may still be compressed or swapped.
        let marked = self.never_share(id, g);
        let sigs = self.domain(d).similar.detector().signatures(page);
        // DE §3.2–3.3 keeps a patch whenever it is under its cut-off; here the page is
        // stored in the smaller of its patch and its compressed form (the patch on a tie
        // of slots, as DE prefers it): a patch under the cut-off can still take more
        // store than the compressed page (docs/live-de.md).
        let compressed = if a.compress && seen && untried {
            self.compress_page(page)
        } else {
            None
        };
        let beat = compressed
            .as_ref()
            .map_or(PAGE_SIZE, |b| slot_size(b.len()));
        // The backings' refusals so far: one during this page's tries is theirs, not the
        // page's (a full disk, a store out of memory).
        let refusals = (self.books.blob_write_errors, self.budget.swap_full);
        if a.patch
            && !marked
            && seen
            && untried
            && self.try_patch(id, g, gpn, &sigs, page, home, beat)
        {
            return;
        }
        if a.compress && seen && untried {
            if compressed.is_some_and(|blob| self.store_compressed(id, g, page, &blob, home)) {
                return;
            }
            // Incompressible and unpatchable as it is: spare the CPU until it changes. Not
            // when a backing refused its blob: the page is as worth storing as before,
            // and marked it would stay uncompressed until the guest wrote it.
            if (self.books.blob_write_errors, self.budget.swap_full) == refusals {
                (self.vms.get_mut(&id).expect("sharable").hints).set_de_failed(g, true);
            }
        }
        // A swap file found full just now (`swap_wanted` reset) takes no raw page either.
        if to_swap && self.budget.swap_wanted > 0 {
            if let Some(slot) = self.put_blob(id, page, BlobHome::Swap) {
                self.queue_stash(
                    id,
                    g,
                    slot,
                    PAGE_SIZE,
                    Form::Raw,
                    None,
                    BlobHome::Swap,
                    None,
                    page_checksum(page),
                    false,
                );
                return;
            }
        }
        if a.reference && !marked {
            self.domain_mut(d)
                .similar
                .insert(&sigs, RefPage::Guest(gpn));
        }
    }

    /// Reads reference candidate `c` of domain `d` (a pool frame something holds, or a
    /// sharable guest page of the same domain) into `out`.
    fn candidate(&self, d: DomainId, c: RefPage, out: &mut Page) -> bool {
        let dom = self.domain(d);
        match c {
            RefPage::Frame(f) => {
                // Only a frame something maps or patches against is immutable; a
                // withdrawn one held a never-share page (never_share.rs).
                dom.frames.contains(f)
                    && dom.frames.refcount(f) > 0
                    && !dom.withdrawn.contains(&f)
                    && dom.pool.read(f.offset(), out).is_ok()
            }
            // A candidate's guest may have left and its gpn gone to another domain's guest:
            // patch references come from the guest's own domain only.
            RefPage::Guest(gpn) => self
                .locate(gpn)
                .filter(|&(id2, g2)| {
                    self.dom(id2) == d && self.sharable(id2, g2) && !self.never_share(id2, g2)
                })
                .is_some_and(|(id2, g2)| self.vms[&id2].ram.read(g2, out).is_ok()),
        }
    }

    /// Patches page `g` against its most similar reference candidate (DE §3.2, §4.3):
    /// every candidate whose signatures still match gets a patch, the smallest under the
    /// cut-off whose slot is at most `beat` bytes (the page's compressed slot; DE's
    /// preference on a tie) and under a page is kept. A guest page chosen as reference
    /// is copied into a pool frame (which no guest can write, so the patch stays valid
    /// whatever the guest does) and shared onto it; the frame takes the page's slots in
    /// the index and is kept there across clears. Returns whether a stash was queued
    /// (not if the pool cannot take the reference frame).
    #[allow(clippy::too_many_arguments)]
    fn try_patch(
        &mut self,
        id: VmId,
        g: Gfn,
        gpn: Gpn,
        sigs: &[u32; 8],
        page: &Page,
        home: BlobHome,
        beat: usize,
    ) -> bool {
        let d = self.dom(id);
        let mut cands = Vec::new();
        self.domain(d).similar.candidates(sigs, &mut cands);
        let codec = self.cfg.patch_codec;
        let mut other = [0u8; PAGE_SIZE];
        let mut blob = Vec::new();
        let mut best: Option<(RefPage, Vec<u8>, Box<Page>)> = None;
        for c in cands {
            if let RefPage::Frame(f) = c {
                // A bucket neighbour, told by its kept signatures without reading it
                // (which would bring it back into RAM were it paged out: kernel_swap.rs).
                let kept = self.domain(d).similar.kept_signatures(f);
                if kept.is_some_and(|k| !k.iter().zip(sigs).any(|(a, b)| a == b)) {
                    continue;
                }
            }
            if c == RefPage::Guest(gpn) {
                continue;
            }
            if !self.candidate(d, c, &mut other) {
                // No reference any more (shared, stored or gone since it was indexed):
                // left in place it would hold the bucket (c = 1) until the next clear,
                // every near-duplicate offered meanwhile would find no reference and be
                // marked failed until written. Its slots go to this page.
                self.domain_mut(d).similar.evict(sigs, c);
                continue;
            }
            if let RefPage::Frame(f) = c {
                // Read just now: not a frame to page out this round (kernel_swap.rs).
                self.domain_mut(d).frames.touch(f);
            }
            if !self.domain(d).similar.matches(sigs, &other) || other == *page {
                continue; // a bucket neighbour or changed; identical is the share scan's
            }
            let started = self.clock.now_ns();
            if codec.encode(&other, page, &mut blob).is_err() {
                continue;
            }
            let took = self.clock.now_ns().saturating_sub(started);
            self.books.record_encode(0, took);
            if !blob.is_empty()
                && blob.len() <= self.cfg.patch_cutoff
                && slot_size(blob.len()) < PAGE_SIZE
                && slot_size(blob.len()) <= beat
                && best.as_ref().is_none_or(|b| blob.len() < b.1.len())
            {
                best = Some((c, blob.clone(), Box::new(other)));
            }
        }
        let Some((c, blob, reference)) = best else {
            return false;
        };
        let Some(slot) = self.put_blob(id, &blob, home) else {
            return false;
        };
        let f = match c {
            RefPage::Frame(f) => f,
            RefPage::Guest(rgpn) => {
                let (id2, g2) = self.locate(rgpn).expect("candidate() located it");
                let h = (self.cfg.page_hash)(&reference);
                let Some(f) = self.alloc_frame(d, &reference, h) else {
                    self.space(id, home).expect("put above").free(slot.id);
                    return false;
                };
                let dom = self.domain_mut(d);
                dom.share.insert(h, ShareEntry::Shared(f));
                let ref_sigs = dom.similar.detector().signatures(&reference);
                dom.similar
                    .replace(&ref_sigs, RefPage::Guest(rgpn), RefPage::Frame(f));
                dom.similar.keep(&ref_sigs, f);
                self.enqueue_share(id2, g2, f);
                f
            }
        };
        self.domain_mut(d).frames.incref(f, true);
        let form = Form::Encoded(Encoding::Patch(codec));
        self.queue_stash(
            id,
            g,
            slot,
            blob.len(),
            form,
            Some(f),
            home,
            None,
            page_checksum(page),
            false,
        );
        true
    }

    /// Page `page` compressed (DE §3.3), if the result is under the cut-off and takes a
    /// slot smaller than a page.
    fn compress_page(&mut self, page: &Page) -> Option<Vec<u8>> {
        let codec = self.cfg.compress_codec;
        let mut blob = Vec::new();
        let started = self.clock.now_ns();
        codec.compress(page, &mut blob).ok()?;
        let took = self.clock.now_ns().saturating_sub(started);
        self.books.record_encode(1, took);
        // A blob whose slot is a whole page would save nothing.
        let fits = !blob.is_empty()
            && blob.len() <= self.cfg.compress_cutoff
            && slot_size(blob.len()) < PAGE_SIZE;
        fits.then_some(blob)
    }

    /// Queues the stash of page `g` as `blob`, its compressed form ([`Self::compress_page`]).
    /// Returns whether it did.
    fn store_compressed(
        &mut self,
        id: VmId,
        g: Gfn,
        page: &Page,
        blob: &[u8],
        home: BlobHome,
    ) -> bool {
        let codec = self.cfg.compress_codec;
        // The kernel keeps it (issue 15): the same choice, the kernel's mechanism.
        if home == BlobHome::Store && self.cfg.compress_backing == CompressBacking::Zswap {
            self.queue_page_out(id, g);
            return true;
        }
        let Some(slot) = self.put_blob(id, blob, home) else {
            return false;
        };
        let form = Form::Encoded(Encoding::Compressed(codec));
        self.queue_stash(
            id,
            g,
            slot,
            blob.len(),
            form,
            None,
            home,
            None,
            page_checksum(page),
            false,
        );
        true
    }

    /// Writes a blob into guest `id`'s store or swap file; `None` if it cannot take it (a
    /// full swap — the guests' swap files together at their capacity — stops swapping
    /// until the next budget check).
    pub(crate) fn put_blob(&mut self, id: VmId, blob: &[u8], home: BlobHome) -> Option<Slot> {
        // Every blob id a P2M entry names is live (2 TiB stored): the page stays in RAM,
        // counted with the blobs not taken. (Each caller records the blob at once.)
        if self.blobs.full() {
            self.books.blob_write_errors += 1;
            if self.books.blob_write_errors.is_power_of_two() {
                tracing::warn!(
                    "{id}: every blob id is live; page left in guest RAM (error {})",
                    self.books.blob_write_errors
                );
            }
            return None;
        }
        let swap_pages: u64 = self
            .vms
            .values()
            .filter_map(|v| v.swap.as_ref())
            .map(|s| s.stats().pages)
            .sum();
        let result = if home == BlobHome::Swap
            // A new chunk may take up to MAX_CHUNK_PAGES pages.
            && (swap_pages + MAX_CHUNK_PAGES) * PAGE_SIZE as u64 > self.swap_capacity
        {
            Err(StoreError::Full {
                capacity: self.swap_capacity,
            })
        } else {
            self.space(id, home)?.put(blob)
        };
        match result {
            Ok(s) => Some(s),
            Err(e @ StoreError::Full { .. }) => {
                self.budget.swap_full += 1;
                self.budget.swap_wanted = 0;
                if self.budget.swap_full.is_power_of_two() {
                    tracing::warn!("{e} (refusal {})", self.budget.swap_full);
                }
                None
            }
            Err(e) => {
                self.books.blob_write_errors += 1;
                if home == BlobHome::Swap {
                    let now = self.now_us();
                    self.budget.swap_failed(now);
                }
                if self.books.blob_write_errors.is_power_of_two() {
                    tracing::warn!(
                        "{id}: {e}; page left in guest RAM (error {})",
                        self.books.blob_write_errors
                    );
                }
                None
            }
        }
    }

    /// Records a blob and queues the stash of page `g` as it (`replaces`: a move of the
    /// stored page's blob `replaces` to this one; `identical`: the page equals its
    /// reference frame, a share without a mapping).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn queue_stash(
        &mut self,
        id: VmId,
        g: Gfn,
        slot: Slot,
        len: usize,
        form: Form,
        reference: Option<FrameId>,
        home: BlobHome,
        replaces: Option<BlobId>,
        checksum: u64,
        identical: bool,
    ) {
        let since_us = match replaces {
            Some(old) => self.blobs.get(old).since_us(),
            None => self.now_us(),
        };
        let blob = Blob::new(
            id, g, home, slot.id, len as u32, form, reference, since_us, identical,
        );
        self.books.slot_bytes[kept_index(blob.kept())] += slot.size as u64;
        let b = self.blobs.insert(blob);
        if let Some(old) = replaces {
            self.blobs.set_replaces(b, old);
        }
        let frees = if replaces.is_some() {
            slot.size as u64
        } else {
            PAGE_SIZE as u64
        };
        if home == BlobHome::Swap {
            self.budget.swap_wanted = self.budget.swap_wanted.saturating_sub(frees);
        }
        self.scan.pass_requests += 1;
        let v = self.vms.get_mut(&id).expect("sharable");
        v.set(
            g,
            match replaces {
                Some(_) => PageState::Moving(b),
                None => PageState::Stashing(b),
            },
        );
        v.queue.push(Command::Stash {
            gfn: g,
            blob: b,
            stash: Stash {
                home,
                offset: slot.offset,
                len: len as u32,
                form,
                reference,
                moving: replaces.is_some(),
                checksum,
            },
        });
    }

    /// Over the budget, after the slice's private cold pages: moves the blobs of pages
    /// the slice keeps in the store to the swap file, oldest first (DE §4.6: patched and
    /// compressed pages are swap candidates too). A patch keeps its reference frame.
    fn swap_stored(&mut self, id: VmId, first: Gfn, end: Gfn) {
        let allowed = self.cfg.policy.actions.iter().any(|a| a.swap);
        let v = &self.vms[&id];
        if !allowed || self.budget.swap_wanted == 0 || v.swap.is_none() || v.opted_out {
            return;
        }
        let d = v.domain;
        let mut todo: Vec<(u64, Gfn, BlobId)> = (first.0..end.0)
            .map(Gfn)
            .filter_map(|g| match v.state(g) {
                PageState::Stored(b) if self.blobs.get(b).home() == BlobHome::Store => {
                    Some((self.blobs.get(b).since_us(), g, b))
                }
                _ => None,
            })
            .collect();
        todo.sort_unstable();
        let mut bytes = vec![0u8; PAGE_SIZE];
        for (_, g, old) in todo {
            if self.budget.swap_wanted == 0 {
                break;
            }
            let o = *self.blobs.get(old);
            let bytes = &mut bytes[..o.len() as usize];
            let store = &self.vms[&id].store;
            let read = store.read(store.slot(o.slot).offset, bytes).is_ok();
            let Some(checksum) = read
                .then(|| self.stored_page_checksum(d, &o, bytes))
                .flatten()
            else {
                // The page stays stored where it is; nothing is lost.
                self.books.blob_read_errors += 1;
                if self.books.blob_read_errors.is_power_of_two() {
                    tracing::warn!(
                        "{id} {g}: its stored blob does not read or decode; not moved to swap \
                         (error {})",
                        self.books.blob_read_errors
                    );
                }
                continue;
            };
            let Some(slot) = self.put_blob(id, bytes, BlobHome::Swap) else {
                break;
            };
            if let Some(r) = o.reference() {
                // The move's blob holds the reference frame too until one is released.
                self.domain_mut(d).frames.incref(r, true);
            }
            let len = o.len() as usize;
            self.queue_stash(
                id,
                g,
                slot,
                len,
                o.form,
                o.reference(),
                BlobHome::Swap,
                Some(old),
                checksum,
                o.identical(),
            );
        }
    }

    /// The checksum of the page blob `b` of domain `d` holds, its bytes `bytes` read from
    /// its space: the page decoded (against its reference frame, read from the pool, for a
    /// patch) and summed. `None` if it does not decode or its frame cannot be read. The
    /// record keeps no checksum (8 bytes a stored page, issue 19): the agent keeps the
    /// one its stash brought and checks every decode against it, and only a move to swap
    /// must send one again (the new record's). A blob changed in the store is caught
    /// there all the same: the agent decodes the old blob against its own checksum before
    /// it takes the move (`move_stashed`).
    pub(crate) fn stored_page_checksum(
        &mut self,
        d: DomainId,
        b: &Blob,
        bytes: &[u8],
    ) -> Option<u64> {
        let mut page = [0u8; PAGE_SIZE];
        match b.form {
            Form::Raw => page = bytes.try_into().ok()?,
            Form::Encoded(e) => {
                let mut reference = [0u8; PAGE_SIZE];
                if let Some(f) = b.reference() {
                    // Read just now: not a frame to page out this round (kernel_swap.rs).
                    self.domain_mut(d).frames.touch(f);
                    self.domain(d).pool.read(f.offset(), &mut reference).ok()?;
                }
                e.decode(bytes, b.reference().map(|_| &reference), &mut page)
                    .ok()?;
            }
        }
        Some(page_checksum(&page))
    }

    /// How long a page taken back after `lived_us` waits before it is stored again.
    pub(crate) fn restash_after(&mut self, id: VmId, g: Gfn, lived_us: u64) {
        let v = self.vms.get_mut(&id).expect("live");
        v.hints.restash_after(g, lived_us >= RESTASH_LIVED_US);
    }
}

/// Pages `[first, first + count)` of a guest whose R the NRU clock may take from the
/// guest's own report ([`crate::EngineConfig::clock_from_guest`]): page cache and
/// anonymous pages, whose referenced and active bits the guest's LRU keeps, and free
/// pages in its buddy allocator, which no one uses (bit k of word k/64 for page
/// `first + k`). Kernel, slab and unreported pages are not, nor "free" pages outside the
/// buddy allocator (mapped by no process: the kernel's own, module text, network
/// buffers, which no LRU bit follows): nothing in the report says when the guest uses
/// them, and taken as cold, a page the guest only reads would be stored every pass.
pub(crate) fn guest_lru_mask(
    map: &crate::categories::CategoryMap,
    first: u32,
    count: u32,
) -> Vec<u64> {
    use crate::categories::Category;
    let mut m = vec![0u64; (count as usize).div_ceil(64)];
    for k in 0..count {
        let g = Gfn(first + k);
        let lru = match map.category(g) {
            Category::Cache | Category::Anon => true,
            Category::Free => map.buddy(g),
            _ => false,
        };
        if lru {
            m[k as usize / 64] |= 1 << (k % 64);
        }
    }
    m
}

mod runs;
use runs::candidates_with_data;

#[cfg(test)]
mod tests;
