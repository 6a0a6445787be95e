//! Every invariant the engine keeps, checked against each other, for tests: the books of
//! frames, blobs and slots agree with the pages that hold them, and the counters with
//! the pages they count.

use std::collections::HashMap;

use super::{kept_index, Command, Engine};
use crate::blobs::{BlobHome, Kept};
use crate::ids::{DomainId, FrameId, Gfn, Gpn, VmId};
use crate::p2m::{BlobId, PageState};
use crate::share::ShareEntry;

impl Engine {
    /// Verifies every invariant and returns the first violation:
    /// - a frame's count is its mappings plus the patches using it; its pending count
    ///   is the share requests naming it; a frame is in use exactly while something
    ///   holds it (or it is pinned by an adopted pool);
    /// - each blob is held by exactly one page (a move's new blob and the one it
    ///   replaces by the same page), names that page, and lives in a slot of its space;
    /// - share-table entries name frames in use whose recorded hash matches, and hints,
    ///   similarity candidates and kept hints name pages of guests of their own domain
    ///   (no share or patch crosses domains; a guest that left names nothing, so its
    ///   page space is given to the next guest clean);
    /// - every guest's domain exists, and a never-share guest's domain holds no other
    ///   guest (Satori §4.3); a blob lives in its own guest's store or swap file
    ///   and patches against a frame of its guest's domain;
    /// - every queued command's page is in the matching in-flight state, and so is every
    ///   page whose share a disk read asked for;
    /// - each guest's "now" counters equal the pages in that state; slot bytes add up;
    ///   its unmapped ages mark only pages shared without a mapping, as many as counted;
    /// - each frame table's free set is exactly the frames below its next that nothing
    ///   holds; each block index names frames in use, both ways alike; fills under way
    ///   name pages in flight of attached guests, and waiting fills their pages
    ///   (`Engine::check_fills`);
    /// - each guest's shared pages by sharing rank (its entitlement, Satori §4.2) are
    ///   what its pages and their frames' mappings say, and rank n holds n pages per
    ///   frame across guests.
    ///
    /// O(guest memory); meant for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut maps: HashMap<(DomainId, FrameId), u32> = HashMap::new();
        let mut pending: HashMap<(DomainId, FrameId), u32> = HashMap::new();
        let mut slots: HashMap<VmId, [u64; 2]> = HashMap::new();
        let mut blob_holders: HashMap<BlobId, u32> = HashMap::new();
        let mut patch_refs: HashMap<(DomainId, FrameId), u32> = HashMap::new();
        // The guests' gpn ranges are disjoint, none is free, and they are all that is held.
        let mut end = 0u64;
        for (&base, id) in &self.by_base {
            let v = &self.vms[id];
            let last = Gpn(base.0 + v.pages() - 1);
            if (base.0 as u64) < end || self.gpns.is_free(base) || self.gpns.is_free(last) {
                return Err(format!(
                    "{id}: its gpns {base}..={last} overlap or are free"
                ));
            }
            end = last.0 as u64 + 1;
        }
        if let Some(d) = self
            .kept_hints
            .keys()
            .chain(self.fills.index.keys())
            .find(|d| !self.domains.contains_key(d))
        {
            return Err(format!("kept hints or a block index of {d}, which is gone"));
        }
        self.check_fills()?;
        let pages: u64 = self.vms.values().map(|v| v.pages() as u64).sum();
        if self.gpns.held_pages() != pages || self.by_base.len() != self.vms.len() {
            return Err(format!(
                "{} gpns held for {} guests of {pages} pages",
                self.gpns.held_pages(),
                self.vms.len()
            ));
        }
        for (id, v) in &self.vms {
            // Every parked event still waits for its page's answer (early.rs): one that
            // does not is stale, and holds the page's one slot against its next event.
            if let Some((g, e)) = v.early.iter().find(|&(&g, &e)| !v.waits_for_answer(g, e)) {
                return Err(format!(
                    "{id} {g}: {e:?} parked, the page {:?}",
                    v.state(*g)
                ));
            }
            // A guest's category map covers its RAM, and its counts add up to it.
            if let Some(m) = &v.categories {
                let counted: u64 = m.counts().pages.iter().sum();
                if m.pages() != v.pages() || counted != v.pages() as u64 {
                    return Err(format!(
                        "{id}: category map of {} pages counting {counted}, guest of {}",
                        m.pages(),
                        v.pages()
                    ));
                }
            }
            if !self.domains.contains_key(&v.domain) {
                return Err(format!("{id}: its {} does not exist", v.domain));
            }
            if v.sharing == super::Sharing::NeverShare {
                if let Some((other, _)) = self
                    .vms
                    .iter()
                    .find(|(o, w)| *o != id && w.domain == v.domain)
                {
                    return Err(format!(
                        "{id} is never-share, and {other} is in its {}",
                        v.domain
                    ));
                }
            }
            // A share asked at disk read is booked when answered: its page is still in
            // flight (Satori §4.1, `at_read`).
            if let Some(g) = v
                .read_sharing
                .keys()
                .find(|g| !matches!(v.state(**g), PageState::Sharing(_)))
            {
                return Err(format!(
                    "{id} {g}: a read share under way for a page in {:?}",
                    v.state(*g)
                ));
            }
            v.unmapped_ages
                .check(&v.clock, v.pages(), |g| {
                    matches!(v.state(g), PageState::Unmapped(_))
                })
                .map_err(|e| format!("{id}: {e}"))?;
            let d = v.domain;
            slots.insert(*id, [0, 0]);
            let mut kept = [0u64; 4];
            let (mut shared, mut zero, mut free, mut paged) = (0u64, 0u64, 0u64, 0u64);
            for (i, e) in v.p2m.iter().enumerate() {
                paged += u64::from(e.is_paged_out());
                let at = || format!("{id} gfn {i}");
                // A page-out under way is forgotten at any state change (`Vm::set`).
                if v.hints.page_out_going(Gfn(i as u32))
                    && (e.state() != PageState::Private || e.is_paged_out())
                {
                    return Err(format!(
                        "{}: a page-out under way for a page in {e:?}",
                        at()
                    ));
                }
                let mut hold = |b: BlobId| -> Result<(), String> {
                    *blob_holders.entry(b).or_default() += 1;
                    if !self.blobs.contains(b) {
                        return Err(format!("{}: blob {b:?} is not live", at()));
                    }
                    let blob = self.blobs.get(b);
                    if blob.vm != *id || blob.gfn.index() != i {
                        return Err(format!(
                            "{}: blob {b:?} names {} {}",
                            at(),
                            blob.vm,
                            blob.gfn
                        ));
                    }
                    Ok(())
                };
                match e.state() {
                    PageState::Shared(f) => {
                        *maps.entry((d, f)).or_default() += 1;
                        shared += 1;
                    }
                    PageState::Sharing(f) => *pending.entry((d, f)).or_default() += 1,
                    PageState::Zero => {
                        zero += 1;
                        free += u64::from(e.is_free_hole());
                    }
                    PageState::Stored(b) => {
                        hold(b)?;
                        kept[kept_index(self.blobs.get(b).kept())] += 1;
                    }
                    PageState::Stashing(b) => hold(b)?,
                    PageState::Unmapped(f) => {
                        // Its patch reference, counted against the frame's books below.
                        *patch_refs.entry((d, f)).or_default() += 1;
                        kept[kept_index(Kept::Unmapped)] += 1;
                    }
                    PageState::Moving(b) => {
                        hold(b)?;
                        let Some(old) = self.blobs.replaces(b) else {
                            return Err(format!("{}: moving blob {b:?} replaces nothing", at()));
                        };
                        hold(old)?;
                        kept[kept_index(self.blobs.get(old).kept())] += 1;
                    }
                    PageState::Private | PageState::Reclaiming => {}
                }
            }
            let b = &v.books;
            let want = [
                b.patched_pages,
                b.compressed_pages,
                b.swapped_pages,
                b.unmapped_pages,
            ];
            if paged != b.paged_out_pages {
                return Err(format!(
                    "{id}: books say {} pages paged out, pages say {paged}",
                    b.paged_out_pages
                ));
            }
            if free != b.free_reclaimed_pages {
                return Err(format!(
                    "{id}: books say {} discarded free pages untouched, pages say {free}",
                    b.free_reclaimed_pages
                ));
            }
            if (shared, zero, kept) != (b.shared_pages, b.zero_reclaimed_pages, want) {
                return Err(format!(
                    "{id}: books say {} shared, {} zero, {want:?} kept; pages say {shared}, {zero}, {kept:?}",
                    b.shared_pages, b.zero_reclaimed_pages
                ));
            }
            let zero_frames = &self.domains[&v.domain].zero_frames;
            let on_zero = v
                .p2m
                .iter()
                .filter(|e| matches!(e.state(), PageState::Shared(f) if zero_frames.contains(&f)))
                .count() as u64;
            if on_zero != b.zero_shared_pages {
                return Err(format!(
                    "{id}: books say {} pages shared onto the zero frame, pages say {on_zero}",
                    b.zero_shared_pages
                ));
            }
            for c in &v.queue {
                let ok = match *c {
                    Command::Share { gfn, frame } | Command::Fill { gfn, frame, .. } => {
                        v.state(gfn) == PageState::Sharing(frame)
                    }
                    Command::Reclaim { gfn } => v.state(gfn) == PageState::Reclaiming,
                    // A shared or stored page keeps its state until the answer, and
                    // may be CoW-broken or decoded meanwhile.
                    Command::DiscardFree { gfn } => {
                        v.free_watch.held.contains(&gfn) || v.state(gfn) == PageState::Reclaiming
                    }
                    // A move whose page the guest took back meanwhile stays queued,
                    // its blob an orphan: the agent will answer it `Changed`.
                    Command::Stash { gfn, blob, stash } if stash.moving => {
                        v.state(gfn) == PageState::Moving(blob) || self.orphans.contains(&blob)
                    }
                    Command::Stash { gfn, blob, .. } => v.state(gfn) == PageState::Stashing(blob),
                    // Not while its discard is under way (free_discard.rs: the watch
                    // would re-arm the page for that discard after a write).
                    Command::Watch { gfn, .. } => !v.free_watch.held.contains(&gfn),
                    // Nothing in flight: the page may change before the agent acts.
                    Command::ClockScan { .. }
                    | Command::TakeBack { .. }
                    | Command::PageOut { .. } => true,
                };
                if !ok {
                    return Err(format!(
                        "{id}: queued {c:?} but the page is {:?}",
                        c.gfn().map_or(PageState::Private, |g| v.state(g))
                    ));
                }
            }
        }
        for &b in &self.orphans {
            if !self.blobs.contains(b) || self.blobs.replaces(b).is_some() {
                return Err(format!(
                    "orphan blob {b:?} is not live, or still replaces one"
                ));
            }
            *blob_holders.entry(b).or_default() += 1;
        }
        let mut slot_bytes = [0u64; 4];
        for (b, blob) in self.blobs.iter() {
            if blob_holders.get(&b) != Some(&1) {
                return Err(format!(
                    "blob {b:?} ({} {}) held by {} pages",
                    blob.vm,
                    blob.gfn,
                    blob_holders.get(&b).copied().unwrap_or(0)
                ));
            }
            let Some(owner) = self.vms.get(&blob.vm) else {
                return Err(format!("blob {b:?} of {}, which is gone", blob.vm));
            };
            if let Some(f) = blob.reference() {
                *patch_refs.entry((owner.domain, f)).or_default() += 1;
            }
            // A page being shared without a mapping is its reference frame's bytes. The
            // record keeps no checksum of the page (the reference model's reads check
            // those: sim.rs); the frame must be one its domain holds, and hold the bytes
            // its books' content hash says.
            if blob.identical() {
                let Some(f) = blob.reference() else {
                    return Err(format!("blob {b:?} is identical to no frame"));
                };
                let dom = &self.domains[&owner.domain];
                if !dom.frames.contains(f) || !dom.frames.is_used(f) {
                    return Err(format!(
                        "blob {b:?} ({} {}) is identical to {f:?}, which nothing holds",
                        blob.vm, blob.gfn
                    ));
                }
                let mut frame = [0u8; crate::PAGE_SIZE];
                let read = dom.pool.read(f.offset(), &mut frame);
                // Only a withdrawn frame may be unreadable (an adopted one memfoldd
                // could not read: its bytes unknown, never a reference).
                if read.is_err() && !dom.withdrawn.contains(&f) {
                    return Err(format!(
                        "blob {b:?} ({} {}) is identical to {f:?}, which cannot be read",
                        blob.vm, blob.gfn
                    ));
                }
                if read.is_ok() && (self.cfg.page_hash)(&frame) != dom.frames.hash(f) {
                    return Err(format!(
                        "blob {b:?} ({} {}) is identical to {f:?}, which holds other bytes \
                         than its content hash says",
                        blob.vm, blob.gfn
                    ));
                }
            }
            if blob.home() == BlobHome::Swap && owner.swap.is_none() {
                return Err(format!("blob {b:?} in the swap file {} lacks", blob.vm));
            }
            slots.get_mut(&blob.vm).expect("every guest listed")
                [(blob.home() == BlobHome::Swap) as usize] += 1;
            let Some(slot) = owner
                .space(blob.home())
                .and_then(|s| s.find_slot(blob.slot))
            else {
                return Err(format!("blob {b:?}'s slot {:?} is not live", blob.slot));
            };
            slot_bytes[kept_index(blob.kept())] += slot.size as u64;
        }
        for (id, v) in &self.vms {
            let held = [
                v.store.stats().slots,
                v.swap.as_ref().map_or(0, |s| s.stats().slots),
            ];
            if slots[id] != held {
                return Err(format!(
                    "{id}: {:?} blobs in its store and swap, its slabs hold {held:?}",
                    slots[id]
                ));
            }
        }
        for k in [
            Kept::Patched,
            Kept::Compressed,
            Kept::Swapped,
            Kept::Unmapped,
        ] {
            if self.slot_bytes_of(k) != slot_bytes[kept_index(k)] {
                return Err(format!(
                    "{k:?}: books hold {} slot bytes, blobs {}",
                    self.slot_bytes_of(k),
                    slot_bytes[kept_index(k)]
                ));
            }
        }
        for (&d, dom) in &self.domains {
            dom.frames.check().map_err(|e| format!("{d}: {e}"))?;
            let mut in_use = 0;
            for i in 0..dom.frames.size() {
                let f = FrameId(i);
                let (m, p, r) = (
                    maps.get(&(d, f)).copied().unwrap_or(0),
                    pending.get(&(d, f)).copied().unwrap_or(0),
                    patch_refs.get(&(d, f)).copied().unwrap_or(0),
                );
                if dom.frames.refcount(f) != m + r
                    || dom.frames.patch_refs(f) != r
                    || dom.frames.pending(f) != p
                {
                    return Err(format!(
                        "{d} {f}: refcount {} (patches {}), pending {}; but {m} mappings, {r} patches, {p} requests",
                        dom.frames.refcount(f),
                        dom.frames.patch_refs(f),
                        dom.frames.pending(f)
                    ));
                }
                in_use += dom.frames.is_used(f) as u32;
                // A used frame of zeros is the zero frame: pages on any other would earn
                // entitlement for zeros (Satori §4.2) and miss the zero books. (A frame
                // pinned only by an adoption is not read yet, and one withdrawn because it
                // could not be read at the adoption never was: their hashes mean nothing.)
                let pinned_only = dom.frames.is_adopted(f)
                    && dom.frames.refcount(f) == 0
                    && dom.frames.pending(f) == 0;
                let unread = pinned_only || dom.withdrawn.contains(&f);
                if dom.frames.is_used(f) && !unread && dom.frames.hash(f) == self.zero_hash {
                    let mut frame = [0u8; crate::PAGE_SIZE];
                    if dom.pool.read(f.offset(), &mut frame).is_ok()
                        && crate::is_zero_page(&frame)
                        && !dom.zero_frames.contains(&f)
                    {
                        return Err(format!("{d} {f}: holds zeros, not booked as a zero frame"));
                    }
                }
            }
            if in_use != dom.frames.in_use() {
                return Err(format!(
                    "{d}: {in_use} frames held, books say {}",
                    dom.frames.in_use()
                ));
            }
            for (tag, e) in dom.share.entries() {
                match e {
                    ShareEntry::Shared(f) => {
                        if !self.frame_held(d, f) {
                            return Err(format!("{d}: share table names {f}, which nothing holds"));
                        }
                        if (dom.frames.hash(f) >> 32) as u32 != tag {
                            return Err(format!("{d}: share table lists {f} under another hash"));
                        }
                        if dom.withdrawn.contains(&f) {
                            return Err(format!(
                                "{d}: share table names {f}, withdrawn (a never-share page's, or unreadable)"
                            ));
                        }
                    }
                    ShareEntry::Hint(gpn) => self.names_own_page(d, gpn, "share table hint")?,
                }
            }
            for gpn in dom.similar.guest_candidates() {
                self.names_own_page(d, gpn, "similarity candidate")?;
            }
            for &(_, gpn) in self.kept_hints.get(&d).into_iter().flatten() {
                self.names_own_page(d, gpn, "kept hint")?;
            }
            if let Some(f) = dom.withdrawn.iter().find(|&&f| !dom.frames.is_used(f)) {
                return Err(format!(
                    "{d}: withdrawn frame {f} is free: it should be forgotten"
                ));
            }
            if let Some(z) = dom.zero_frames.iter().find(|&&z| !self.frame_held(d, z)) {
                return Err(format!("{d}: zero frame {z} is not held"));
            }
        }
        // Entitlements (Satori §4.2): each guest's pages by rank, counted here from the
        // P2Ms alone, equal what the books derive from the frame table (refcounts less
        // patch references, checked against the P2Ms above). A page shared without a
        // mapping holds its frame as a page does (its rank).
        let mut holders = maps.clone();
        for v in self.vms.values() {
            for e in v.p2m.iter() {
                if let PageState::Unmapped(f) = e.state() {
                    *holders.entry((v.domain, f)).or_default() += 1;
                }
            }
        }
        let all_ranks = self.all_sharing_ranks();
        for (id, v) in &self.vms {
            let zero = &self.domains[&v.domain].zero_frames;
            let mut want: std::collections::BTreeMap<u32, u64> = Default::default();
            for e in v.p2m.iter() {
                if let PageState::Shared(f) | PageState::Unmapped(f) = e.state() {
                    if !zero.contains(&f) {
                        *want.entry(holders[&(v.domain, f)]).or_default() += 1;
                    }
                }
            }
            let want: Vec<(u32, u64)> = want.into_iter().collect();
            let have = self.sharing_ranks(*id).expect("listed").0;
            if all_ranks.get(id).map(|r| &r.0) != Some(&have) {
                return Err(format!(
                    "{id}: ranks of all guests at once differ from its own"
                ));
            }
            if have != want {
                return Err(format!(
                    "{id}: books give shared pages by rank {have:?}, its pages say {want:?}"
                ));
            }
        }
        for (d, f) in maps.keys().chain(pending.keys()).chain(patch_refs.keys()) {
            if !self
                .domains
                .get(d)
                .is_some_and(|dom| dom.frames.contains(*f))
            {
                return Err(format!("{f} is past the end of the pool of {d}"));
            }
        }
        Ok(())
    }

    /// Whether `gpn`, named by domain `d`'s `what`, is a page of a guest of `d`.
    fn names_own_page(&self, d: DomainId, gpn: Gpn, what: &str) -> Result<(), String> {
        match self.locate(gpn) {
            Some((id, _)) if self.vms[&id].domain == d => Ok(()),
            Some((id, _)) => Err(format!(
                "{d}: {what} at {gpn} of {id}, in {}",
                self.vms[&id].domain
            )),
            None => Err(format!("{d}: {what} at {gpn}, which no guest holds")),
        }
    }
}
