//! The mechanisms, page by page: share (ESX §4.3, DE §3.1), reference indexing and patching
//! (DE §3.2, §4.3), compression (DE §3.3) and swap-out (DE §3.4, §4.6). Each is callable
//! directly (tests, benchmarks, the live layer's own policies); [`Engine::tick`] calls them
//! as the clock policy allows.

use serde::Serialize;

use super::{Engine, ZeroPolicy};
use crate::blobstore::BlobKind;
use crate::error::{EngineError, Result};
use crate::frames::IN_SHARE_TABLE;
use crate::share::{ShareEntry, ShareTable};
use crate::types::{is_zero_page, Frame, Gfn, PageState, VmId, PAGE_SIZE};

/// Result of [`Engine::try_share`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum ShareOutcome {
    /// Now mapped onto a frame shared with an identical page; its own frame was freed.
    Shared,
    /// All zeros and reclaimed (no frame).
    ZeroReclaimed,
    /// No identical page known yet: entered as a hint.
    Hinted,
    /// Already shared (its frame is (re-)entered in the table).
    AlreadyShared,
    /// Its hash is outside the current pass's interval (DE §4.3 partitioning).
    Deferred,
    /// Not a resident private page (or a zero page under [`ZeroPolicy::Never`]).
    NotEligible,
    /// Its hash chain is full of other content: ineligible, as ESX treats false matches.
    ChainFull,
}

/// Result of [`Engine::try_patch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum PatchOutcome {
    /// Stored as a patch of this many bytes; its frame was freed.
    Patched(u16),
    /// The best candidate turned out identical: shared instead.
    Shared,
    /// No candidate page shares a signature.
    NoCandidate,
    /// Every candidate's patch was over the cut-off.
    TooLarge,
    /// Not a resident private non-zero page.
    NotEligible,
}

/// Result of [`Engine::try_compress`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum CompressOutcome {
    /// Stored compressed in this many bytes; its frame was freed.
    Compressed(u16),
    /// Compressed size over the cut-off: left as it was.
    TooLarge,
    /// Not a resident private page.
    NotEligible,
}

/// Result of [`Engine::swap_out`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum SwapOutcome {
    /// Written to this slot.
    Swapped(u32),
    /// The swap file is full (swap-out is a hint: nothing changed).
    SwapFull,
    /// Nothing to swap (zero, never-written or already swapped).
    NotEligible,
}

impl Engine {
    /// Tries to share a resident page with an identical one (ESX §4.3): hash it, look the
    /// hash up, confirm byte for byte, then map it copy-on-write onto the existing frame and
    /// free its own. A zero page is reclaimed (or not) as [`ZeroPolicy`] says. A page with no
    /// match becomes a hint; a later identical page finds it and both end up shared.
    ///
    /// Errors: [`EngineError::NoSuchVm`], [`EngineError::GfnOutOfRange`].
    pub fn try_share(&mut self, vm: VmId, gfn: Gfn) -> Result<ShareOutcome> {
        self.check(vm, gfn)?;
        let f = match self.entry(vm, gfn).state() {
            PageState::Private(f) => f,
            PageState::Shared(f) => {
                // Re-enter the frame after a partitioned pass cleared the table.
                self.list(f);
                return Ok(ShareOutcome::AlreadyShared);
            }
            _ => return Ok(ShareOutcome::NotEligible),
        };
        if is_zero_page(self.frames.data(f)) {
            match self.cfg.zero_pages {
                ZeroPolicy::Reclaim => {
                    self.put_frame(f);
                    self.set_entry(vm, gfn, PageState::Zero);
                    self.counters.zero_reclaims += 1;
                    return Ok(ShareOutcome::ZeroReclaimed);
                }
                ZeroPolicy::Never => return Ok(ShareOutcome::NotEligible),
                ZeroPolicy::AsContent => {}
            }
        }
        let h = self.hash(self.frames.data(f));
        if !self.share.in_current_pass(h) {
            return Ok(ShareOutcome::Deferred);
        }
        let me = self.gpn(vm, gfn);
        // Copy the chain out (at most MAX_CHAIN entries, no allocation): matching mutates it.
        let mut chain = [None; ShareTable::MAX_CHAIN];
        for (slot, e) in chain.iter_mut().zip(self.share.lookup(h)) {
            *slot = Some(e);
        }
        let mut hinted_already = false;
        for e in chain.into_iter().flatten() {
            match e {
                ShareEntry::Shared(s) => {
                    if self.frames.data(s) == self.frames.data(f) {
                        self.map_shared(vm, gfn, f, s);
                        return Ok(ShareOutcome::Shared);
                    }
                    self.counters.hash_false_matches += 1;
                }
                ShareEntry::Hint(g) if g == me => hinted_already = true,
                ShareEntry::Hint(g) => {
                    let other = self.gpns.owner(g).and_then(|(v2, gfn2)| {
                        match self.entry(v2, gfn2).state() {
                            PageState::Private(f2) => Some((v2, gfn2, f2)),
                            _ => None,
                        }
                    });
                    match other {
                        Some((v2, gfn2, f2)) if self.frames.data(f2) == self.frames.data(f) => {
                            // The hinted page becomes the shared frame's first user.
                            self.share.replace(h, e, ShareEntry::Shared(f2));
                            self.frames.set_flag(f2, IN_SHARE_TABLE, true);
                            self.set_entry(v2, gfn2, PageState::Shared(f2));
                            self.map_shared(vm, gfn, f, f2);
                            return Ok(ShareOutcome::Shared);
                        }
                        Some((_, _, f2)) if self.hash(self.frames.data(f2)) == h => {
                            self.counters.hash_false_matches += 1;
                        }
                        _ => {
                            // Stale: the hinted page changed or went away.
                            self.share.remove(h, e);
                        }
                    }
                }
            }
        }
        if hinted_already {
            Ok(ShareOutcome::Hinted)
        } else if self.share.insert(h, ShareEntry::Hint(me)) {
            self.counters.hints += 1;
            Ok(ShareOutcome::Hinted)
        } else {
            self.counters.share_chain_full += 1;
            Ok(ShareOutcome::ChainFull)
        }
    }

    /// Maps page (vm, gfn), now privately on `own`, onto identical shared frame `s`.
    fn map_shared(&mut self, vm: VmId, gfn: Gfn, own: Frame, s: Frame) {
        self.frames.incref(s);
        self.set_entry(vm, gfn, PageState::Shared(s));
        self.put_frame(own);
        self.counters.shares += 1;
    }

    /// Enters a resident non-zero page in the similarity index as a possible reference page
    /// (DE §4.2: C2 pages "are considered ... to be reference pages for patching").
    /// Returns whether any bucket took it.
    ///
    /// Errors: [`EngineError::NoSuchVm`], [`EngineError::GfnOutOfRange`].
    pub fn index_reference(&mut self, vm: VmId, gfn: Gfn) -> Result<bool> {
        self.check(vm, gfn)?;
        let f = match self.entry(vm, gfn).state() {
            PageState::Private(f) | PageState::Shared(f) => f,
            _ => return Ok(false),
        };
        if is_zero_page(self.frames.data(f)) {
            return Ok(false);
        }
        let sigs = self.sim.detector().signatures(self.frames.data(f));
        let gpn = self.gpn(vm, gfn);
        Ok(self.sim.insert(&sigs, gpn) > 0)
    }

    /// Tries to store a resident private page as a patch against a similar page (DE §3.2):
    /// looks its signatures up in the similarity index, encodes a patch against every
    /// candidate still resident, keeps the smallest if under the cut-off.
    ///
    /// The reference page's frame becomes immutable: it is marked shared (a later write to
    /// the reference page is a CoW break, leaving the old content to the patches) and holds
    /// one reference count per patch. So writing a reference page never corrupts the pages
    /// patched against it, and a reference frame lives as long as a patch needs it.
    ///
    /// Errors: [`EngineError::NoSuchVm`], [`EngineError::GfnOutOfRange`]. If no frame is
    /// left for the blob store, the page is left as it was ([`PatchOutcome::TooLarge`] is
    /// not returned for that; the error [`EngineError::FramesExhausted`] is).
    pub fn try_patch(&mut self, vm: VmId, gfn: Gfn) -> Result<PatchOutcome> {
        self.check(vm, gfn)?;
        let f = match self.entry(vm, gfn).state() {
            PageState::Private(f) => f,
            _ => return Ok(PatchOutcome::NotEligible),
        };
        if is_zero_page(self.frames.data(f)) {
            return Ok(PatchOutcome::NotEligible);
        }
        let sigs = self.sim.detector().signatures(self.frames.data(f));
        let mut cands = std::mem::take(&mut self.cand_buf);
        self.sim.candidates(&sigs, &mut cands);
        let me = self.gpn(vm, gfn);
        let mut best: Option<(VmId, Gfn, Frame)> = None;
        let mut any = false;
        for &g in &cands {
            let Some((v2, gfn2)) = self.gpns.owner(g) else {
                continue;
            };
            if g == me {
                continue;
            }
            let r = match self.entry(v2, gfn2).state() {
                PageState::Private(r) | PageState::Shared(r) => r,
                _ => continue,
            };
            if !self.sim.matches(&sigs, self.frames.data(r)) {
                continue; // bucket neighbour, or changed since it was indexed
            }
            any = true;
            self.cfg
                .patch_codec
                .encode(self.frames.data(r), self.frames.data(f), &mut self.blob_buf)
                .expect("patch encoding of two pages cannot fail");
            if self.blob_buf.len() <= self.cfg.patch_cutoff
                && best.is_none_or(|_| self.blob_buf.len() < self.best_buf.len())
            {
                std::mem::swap(&mut self.blob_buf, &mut self.best_buf);
                best = Some((v2, gfn2, r));
            }
        }
        self.cand_buf = cands;
        let Some((v2, gfn2, r)) = best else {
            if any {
                self.counters.patch_rejected += 1;
                return Ok(PatchOutcome::TooLarge);
            }
            self.counters.patch_no_candidate += 1;
            return Ok(PatchOutcome::NoCandidate);
        };
        if self.best_buf.is_empty() || self.frames.data(r) == self.frames.data(f) {
            // Identical after all: sharing is strictly better than an empty patch.
            self.make_reference(v2, gfn2, r);
            self.map_shared(vm, gfn, f, r);
            return Ok(PatchOutcome::Shared);
        }
        let kind = BlobKind::Patch(self.cfg.patch_codec);
        let best_bytes = std::mem::take(&mut self.best_buf);
        let stored = self
            .blobs
            .store(&mut self.frames, &best_bytes, kind, Some(r));
        let len = best_bytes.len() as u16;
        self.best_buf = best_bytes;
        let id = stored.ok_or(EngineError::FramesExhausted)?;
        self.make_reference(v2, gfn2, r);
        self.frames.incref(r);
        self.set_entry(vm, gfn, PageState::Patched(id));
        self.put_frame(f);
        self.counters.patches += 1;
        Ok(PatchOutcome::Patched(len))
    }

    /// Makes the reference page's frame immutable: a private reference page becomes a
    /// shared mapping (and enters the share table so identical pages can join it).
    fn make_reference(&mut self, vm: VmId, gfn: Gfn, r: Frame) {
        if let PageState::Private(_) = self.entry(vm, gfn).state() {
            self.set_entry(vm, gfn, PageState::Shared(r));
            self.list(r);
        }
    }

    /// Tries to compress a resident private page (DE §3.3); keeps it only under the cut-off.
    /// Zero pages compress too (to one 64-byte slot): under a policy without sharing, or
    /// with [`ZeroPolicy::Never`], this is what saves them.
    ///
    /// Errors: [`EngineError::NoSuchVm`], [`EngineError::GfnOutOfRange`],
    /// [`EngineError::FramesExhausted`] (page left as it was).
    pub fn try_compress(&mut self, vm: VmId, gfn: Gfn) -> Result<CompressOutcome> {
        self.check(vm, gfn)?;
        let f = match self.entry(vm, gfn).state() {
            PageState::Private(f) => f,
            _ => return Ok(CompressOutcome::NotEligible),
        };
        let codec = self.cfg.compress_codec;
        codec
            .compress(self.frames.data(f), &mut self.blob_buf)
            .expect("page compression cannot fail");
        if self.blob_buf.len() > self.cfg.compress_cutoff {
            self.counters.compress_rejected += 1;
            return Ok(CompressOutcome::TooLarge);
        }
        let id = self
            .blobs
            .store(
                &mut self.frames,
                &self.blob_buf,
                BlobKind::Compressed(codec),
                None,
            )
            .ok_or(EngineError::FramesExhausted)?;
        let len = self.blob_buf.len() as u16;
        self.set_entry(vm, gfn, PageState::Compressed(id));
        self.put_frame(f);
        self.counters.compressions += 1;
        Ok(CompressOutcome::Compressed(len))
    }

    /// Writes a page to swap and releases what held it in memory (DE §4.6: patched and
    /// compressed pages are rebuilt first and swapped as whole pages). A shared page gives
    /// up its mapping; the frame is freed only if it was the last.
    ///
    /// Errors: [`EngineError::NoSuchVm`], [`EngineError::GfnOutOfRange`],
    /// [`EngineError::SwapIo`], [`EngineError::Corrupt`] (nothing changed).
    pub fn swap_out(&mut self, vm: VmId, gfn: Gfn) -> Result<SwapOutcome> {
        self.check(vm, gfn)?;
        let e = self.entry(vm, gfn);
        if matches!(
            e.state(),
            PageState::Unbacked | PageState::Zero | PageState::Swapped(_)
        ) {
            return Ok(SwapOutcome::NotEligible);
        }
        let mut page = [0u8; PAGE_SIZE];
        self.content(vm, gfn, &mut page)?;
        match self.swap.put(&page) {
            Ok(Some(slot)) => {
                self.release(e);
                self.set_entry(vm, gfn, PageState::Swapped(slot));
                self.counters.swap_outs += 1;
                Ok(SwapOutcome::Swapped(slot))
            }
            Ok(None) => {
                self.counters.swap_full += 1;
                Ok(SwapOutcome::SwapFull)
            }
            Err(msg) => {
                self.counters.swap_io_errors += 1;
                Err(EngineError::SwapIo(msg))
            }
        }
    }

    /// Swap-out as a hint (DE §4.6): swaps out up to `pages` victims chosen from the clock,
    /// coldest first (pages the policy lets swap, then any page not recently modified, then
    /// any resident page), and returns how many it swapped out. Stops early, without error,
    /// when the swap file is full or no victim is left.
    ///
    /// Errors: [`EngineError::SwapIo`] or [`EngineError::Corrupt`] from a victim.
    pub fn swap_out_hint(&mut self, pages: u32) -> Result<u32> {
        Ok(self.swap_victims(pages, None, |_| false)?.0)
    }

    /// Swaps out victims until fewer than `limit` frames are in use. Returns why it had to
    /// stop short (for the error message), or an empty string.
    pub(super) fn reclaim_to_budget(
        &mut self,
        limit: u32,
        exclude: Option<(VmId, Gfn)>,
    ) -> Result<String> {
        let (_, short) = self.swap_victims(u32::MAX, exclude, |in_use| in_use < limit)?;
        Ok(short.unwrap_or_default().to_string())
    }

    /// The victim scan shared by [`Self::swap_out_hint`] and the budget: three rounds over
    /// all pages from the swap cursor, each less picky, until `max` pages are swapped out or
    /// `enough(frames in use)` holds. Returns how many it swapped out, and why it stopped
    /// short of `enough` if it did.
    fn swap_victims(
        &mut self,
        max: u32,
        exclude: Option<(VmId, Gfn)>,
        enough: impl Fn(u32) -> bool,
    ) -> Result<(u32, Option<&'static str>)> {
        let total: u64 = self.vms.values().map(|v| v.p2m.len() as u64).sum();
        let mut done = 0;
        for round in 0..3 {
            for _ in 0..total {
                if done >= max || enough(self.frames.in_use()) {
                    return Ok((done, None));
                }
                let Some((vm, gfn)) = self.advance_swap_cursor() else {
                    return Ok((done, Some("no VM")));
                };
                if Some((vm, gfn)) == exclude {
                    continue;
                }
                let state = self.vms[&vm].clock[gfn as usize].state();
                let ok = match round {
                    0 => self.cfg.policy.for_state(state).swap,
                    1 => state != crate::clock::NruState::C1,
                    _ => true,
                };
                if ok && self.swap_frees_memory(vm, gfn) {
                    match self.swap_out(vm, gfn)? {
                        SwapOutcome::Swapped(_) => done += 1,
                        SwapOutcome::SwapFull => return Ok((done, Some("the swap file is full"))),
                        SwapOutcome::NotEligible => {}
                    }
                }
            }
        }
        let short = (!enough(self.frames.in_use())).then_some("no page left to swap out");
        Ok((done, short))
    }

    /// Whether swapping the page out would free host memory: not for a mapping of a frame
    /// that others keep, nor for a page that holds nothing.
    pub(super) fn swap_frees_memory(&self, vm: VmId, gfn: Gfn) -> bool {
        match self.entry(vm, gfn).state() {
            PageState::Private(_) | PageState::Patched(_) | PageState::Compressed(_) => true,
            PageState::Shared(f) => self.frames.refcount(f) == 1,
            _ => false,
        }
    }

    fn advance_swap_cursor(&mut self) -> Option<(VmId, Gfn)> {
        let (vm, gfn) = self.swap_cursor;
        let cur = match vm {
            Some(v)
                if self
                    .vms
                    .get(&v)
                    .is_some_and(|x| (gfn as usize) < x.p2m.len()) =>
            {
                (v, gfn)
            }
            _ => (self.next_vm_after(vm)?, 0),
        };
        self.swap_cursor = (Some(cur.0), cur.1 + 1);
        Some(cur)
    }
}
