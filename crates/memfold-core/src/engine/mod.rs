//! The engine: per-VM P2M maps over host frames, with every mechanism of the papers.
//!
//! Data flows one way: guest accesses and clock scans (detection) → mechanisms (share,
//! patch, compress, swap and their undo) → accounting. Nothing here makes an OS call; the
//! live layer calls [`Engine::read`]/[`Engine::write`] from its fault handlers and
//! [`Engine::tick`] from its scanner thread.

mod access;
mod check;
mod mechanisms;
mod scan;

use std::collections::{BTreeMap, BTreeSet};

use memfold_codecs::{CompressCodec, PatchCodec};
use serde::Serialize;

use crate::accounting::Counters;
use crate::blobstore::BlobStore;
use crate::clock::{PageClock, Policy};
use crate::error::{EngineError, Result};
use crate::frames::{FrameStore, IN_SHARE_TABLE};
use crate::share::{ShareEntry, ShareTable};
use crate::similarity::{SimilarityConfig, SimilarityDetector, SimilarityIndex};
use crate::swap::{SwapDevice, SwapSpace};
use crate::types::{Frame, Gfn, Gpn, P2mEntry, Page, PageState, VmId, PAGE_SIZE};

pub use access::Access;
pub use mechanisms::{CompressOutcome, PatchOutcome, ShareOutcome, SwapOutcome};
pub use scan::TickReport;

/// What to do with pages found to be all zeros.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum ZeroPolicy {
    /// Reclaim them: the P2M entry becomes [`PageState::Zero`], no frame at all (ESX §4.3
    /// shares them with the zero page; this is the same with a zero refcount cost).
    Reclaim,
    /// Treat them as ordinary content: all zero pages share one frame.
    AsContent,
    /// Never share or reclaim them (Satori §4.1: zero pages are mostly short-lived free
    /// memory, so sharing them is "illusory").
    Never,
}

/// The page hash used by the share table. Tests replace it to force collisions.
pub type PageHash = fn(&Page) -> u64;

/// 64-bit xxh3 of the page (ESX §4.3 uses a 64-bit hash; DE used SuperFastHash).
pub fn xxh3_page_hash(page: &Page) -> u64 {
    xxhash_rust::xxh3::xxh3_64(page)
}

/// Engine parameters.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Which mechanisms the clock may apply to each NRU class (DE §4.2).
    pub policy: Policy,
    /// What to do with zero pages.
    pub zero_pages: ZeroPolicy,
    /// HashSimilarityDetector parameters (DE §3.2).
    pub similarity: SimilarityConfig,
    /// Patch encoding (DE §3.2).
    pub patch_codec: PatchCodec,
    /// Largest patch kept, bytes (DE: 2048).
    pub patch_cutoff: usize,
    /// Compression codec (DE §3.3).
    pub compress_codec: CompressCodec,
    /// Largest compressed page kept, bytes (2048: at least 2:1).
    pub compress_cutoff: usize,
    /// Hash intervals per clock cycle, 1..=6. DE §4.3 (after Kloster et al.) uses 5 so that
    /// the share table holds hints for only about 1/5 of memory; 1 finds identical pages up
    /// to 5 sweeps sooner at about 0.1–0.2% more metadata (see docs/metadata.md).
    pub share_passes: u32,
    /// Host memory budget for everything the engine holds, frames; when reached, pages are
    /// swapped out (DE §3.4). `None`: no budget.
    pub host_frames_limit: Option<u32>,
    /// Least time between the starts of two clock sweeps over a VM, µs (DE §4.2: 4 s).
    pub min_rescan_us: u64,
    /// Page hash for the share table.
    pub page_hash: PageHash,
}

impl Default for EngineConfig {
    /// The Difference Engine policy with the paper's parameters (2 KiB cut-offs, 4 s
    /// rescan, (2,1) similarity, 5 share passes), run-diff patches and LZ4 compression.
    fn default() -> Self {
        EngineConfig {
            policy: Policy::difference_engine(),
            zero_pages: ZeroPolicy::Reclaim,
            similarity: SimilarityConfig::default(),
            patch_codec: PatchCodec::RunDiff,
            patch_cutoff: 2048,
            compress_codec: CompressCodec::Lz4,
            compress_cutoff: 2048,
            share_passes: 5,
            host_frames_limit: None,
            min_rescan_us: 4_000_000,
            page_hash: xxh3_page_hash,
        }
    }
}

/// One VM's guest memory as the engine sees it.
pub(crate) struct Vm {
    /// First gpn of this VM's range.
    base: Gpn,
    /// gfn → what backs it.
    pub(crate) p2m: Vec<P2mEntry>,
    /// gfn → NRU clock byte.
    pub(crate) clock: Vec<PageClock>,
    /// Next gfn the clock scans.
    hand: u32,
    /// When the current (or last) sweep began, µs.
    sweep_start_us: Option<u64>,
}

/// Allocation of disjoint gpn ranges to VMs, first fit with coalescing.
pub(crate) struct GpnSpace {
    free: BTreeMap<Gpn, u32>,
    owners: BTreeMap<Gpn, (VmId, u32)>,
}

/// Gpns must fit the share table's 31-bit hint payload.
const GPN_LIMIT: u32 = 1 << 31;

impl GpnSpace {
    fn new() -> Self {
        GpnSpace {
            free: BTreeMap::from([(0, GPN_LIMIT)]),
            owners: BTreeMap::new(),
        }
    }

    fn alloc(&mut self, vm: VmId, len: u32) -> Option<Gpn> {
        let (&start, &flen) = self.free.iter().find(|(_, &l)| l >= len)?;
        self.free.remove(&start);
        if flen > len {
            self.free.insert(start + len, flen - len);
        }
        self.owners.insert(start, (vm, len));
        Some(start)
    }

    fn release(&mut self, start: Gpn) {
        let (_, len) = self.owners.remove(&start).expect("owned range");
        let (mut s, mut l) = (start, len);
        if let Some((&ps, &pl)) = self.free.range(..s).next_back() {
            if ps + pl == s {
                self.free.remove(&ps);
                s = ps;
                l += pl;
            }
        }
        if let Some(&nl) = self.free.get(&(s + l)) {
            self.free.remove(&(s + l));
            l += nl;
        }
        self.free.insert(s, l);
    }

    fn owner(&self, gpn: Gpn) -> Option<(VmId, Gfn)> {
        let (&base, &(vm, len)) = self.owners.range(..=gpn).next_back()?;
        (gpn - base < len).then_some((vm, gpn - base))
    }
}

/// The memfold engine core. See the crate documentation for the design.
pub struct Engine {
    pub(crate) cfg: EngineConfig,
    pub(crate) frames: FrameStore,
    pub(crate) blobs: BlobStore,
    pub(crate) share: ShareTable,
    pub(crate) sim: SimilarityIndex,
    pub(crate) swap: SwapSpace,
    pub(crate) vms: BTreeMap<VmId, Vm>,
    pub(crate) gpns: GpnSpace,
    pub(crate) next_vm_id: u32,
    /// VM the clock scans next.
    pub(crate) clock_cursor: Option<VmId>,
    /// VMs that have not completed a sweep in the current pass.
    pub(crate) pass_pending: BTreeSet<VmId>,
    /// Position of the swap-victim scan.
    pub(crate) swap_cursor: (Option<VmId>, Gfn),
    pub(crate) counters: Counters,
    /// Reused buffers (no allocation on hot paths).
    pub(crate) blob_buf: Vec<u8>,
    pub(crate) best_buf: Vec<u8>,
    pub(crate) cand_buf: Vec<Gpn>,
}

impl Engine {
    /// A new engine with no VMs, swapping to `swap`.
    ///
    /// Errors: `Err(String)` naming the bad parameter: similarity parameters out of range,
    /// share passes outside 1..=6, or a cut-off above the largest blob (4088 bytes).
    pub fn new(cfg: EngineConfig, swap: Box<dyn SwapDevice>) -> std::result::Result<Self, String> {
        let det = SimilarityDetector::new(cfg.similarity)?;
        if cfg.share_passes == 0 || cfg.share_passes > 6 {
            return Err(format!(
                "share passes = {}, must be in 1..=6",
                cfg.share_passes
            ));
        }
        let max = crate::blobstore::MAX_BLOB;
        if cfg.patch_cutoff > max || cfg.compress_cutoff > max {
            return Err(format!(
                "patch and compression cut-offs must be at most {max} bytes"
            ));
        }
        Ok(Engine {
            share: ShareTable::new(cfg.share_passes),
            sim: SimilarityIndex::new(det),
            frames: FrameStore::new(),
            blobs: BlobStore::new(),
            swap: SwapSpace::new(swap),
            vms: BTreeMap::new(),
            gpns: GpnSpace::new(),
            next_vm_id: 0,
            clock_cursor: None,
            pass_pending: BTreeSet::new(),
            swap_cursor: (None, 0),
            counters: Counters::default(),
            blob_buf: Vec::with_capacity(2 * PAGE_SIZE),
            best_buf: Vec::with_capacity(2 * PAGE_SIZE),
            cand_buf: Vec::new(),
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Changes the clock policy (takes effect at the next page scanned).
    pub fn set_policy(&mut self, policy: Policy) {
        self.cfg.policy = policy;
    }

    /// Operation counters since creation.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Adds a VM of `pages` guest pages, all [`PageState::Unbacked`] (reading zeros).
    ///
    /// Errors: [`EngineError::BadVmSize`] for 0 or more than 2^29 pages,
    /// [`EngineError::GpnExhausted`] when all VMs together would exceed 2^31 pages.
    pub fn create_vm(&mut self, pages: u32) -> Result<VmId> {
        let max = P2mEntry::MAX_PAYLOAD;
        if pages == 0 || pages > max {
            return Err(EngineError::BadVmSize { pages, max });
        }
        let id = VmId(self.next_vm_id);
        let base = self
            .gpns
            .alloc(id, pages)
            .ok_or(EngineError::GpnExhausted { pages })?;
        self.next_vm_id += 1;
        self.vms.insert(
            id,
            Vm {
                base,
                p2m: vec![P2mEntry::UNBACKED; pages as usize],
                clock: vec![PageClock::default(); pages as usize],
                hand: 0,
                sweep_start_us: None,
            },
        );
        self.pass_pending.insert(id);
        if self.sim.is_empty() {
            let pages = self.vms.values().map(|v| v.p2m.len() as u64).sum();
            self.sim.clear_for(pages);
        }
        Ok(id)
    }

    /// Removes a VM, releasing every frame, blob and swap slot it held.
    ///
    /// Errors: [`EngineError::NoSuchVm`].
    pub fn destroy_vm(&mut self, vm: VmId) -> Result<()> {
        let pages = self.vm(vm)?.p2m.len() as u32;
        for gfn in 0..pages {
            let e = self.vms[&vm].p2m[gfn as usize];
            self.release(e);
        }
        let v = self.vms.remove(&vm).expect("checked above");
        self.gpns.release(v.base);
        self.pass_pending.remove(&vm);
        if self.pass_pending.is_empty() && !self.vms.is_empty() {
            self.end_pass();
        }
        Ok(())
    }

    /// VMs managed, in id order.
    pub fn vm_ids(&self) -> Vec<VmId> {
        self.vms.keys().copied().collect()
    }

    /// A VM's size, pages.
    ///
    /// Errors: [`EngineError::NoSuchVm`].
    pub fn vm_pages(&self, vm: VmId) -> Result<u32> {
        Ok(self.vm(vm)?.p2m.len() as u32)
    }

    /// What backs a guest page now.
    ///
    /// Errors: [`EngineError::NoSuchVm`], [`EngineError::GfnOutOfRange`].
    pub fn page_state(&self, vm: VmId, gfn: Gfn) -> Result<PageState> {
        self.check(vm, gfn)?;
        Ok(self.entry(vm, gfn).state())
    }

    /// The page's current NRU class and clock byte.
    ///
    /// Errors: [`EngineError::NoSuchVm`], [`EngineError::GfnOutOfRange`].
    pub fn page_clock(&self, vm: VmId, gfn: Gfn) -> Result<PageClock> {
        self.check(vm, gfn)?;
        Ok(self.vms[&vm].clock[gfn as usize])
    }

    /// Records R/M bits observed outside [`Engine::read`]/[`Engine::write`] (the live layer's
    /// dirty and access tracking, DE §4.2).
    ///
    /// Errors: [`EngineError::NoSuchVm`], [`EngineError::GfnOutOfRange`].
    pub fn note_access(
        &mut self,
        vm: VmId,
        gfn: Gfn,
        referenced: bool,
        modified: bool,
    ) -> Result<()> {
        self.check(vm, gfn)?;
        self.vms.get_mut(&vm).expect("checked").clock[gfn as usize].observe(referenced, modified);
        Ok(())
    }

    // ---- internal helpers shared by the submodules ----

    fn vm(&self, vm: VmId) -> Result<&Vm> {
        self.vms.get(&vm).ok_or(EngineError::NoSuchVm(vm))
    }

    fn check(&self, vm: VmId, gfn: Gfn) -> Result<()> {
        let pages = self.vm(vm)?.p2m.len() as u32;
        if gfn >= pages {
            return Err(EngineError::GfnOutOfRange { vm, gfn, pages });
        }
        Ok(())
    }

    fn entry(&self, vm: VmId, gfn: Gfn) -> P2mEntry {
        self.vms[&vm].p2m[gfn as usize]
    }

    fn set_entry(&mut self, vm: VmId, gfn: Gfn, state: PageState) {
        self.vms.get_mut(&vm).expect("live VM").p2m[gfn as usize] = P2mEntry::new(state);
    }

    fn gpn(&self, vm: VmId, gfn: Gfn) -> Gpn {
        self.vms[&vm].base + gfn
    }

    fn hash(&self, page: &Page) -> u64 {
        (self.cfg.page_hash)(page)
    }

    /// Drops one reference to a frame; when it is the last, takes the frame out of the
    /// share table first, then frees it.
    fn put_frame(&mut self, f: Frame) {
        if self.frames.refcount(f) == 1 {
            self.unlist(f);
        }
        self.frames.decref(f);
    }

    /// Enters a shared frame in the share table if it is not there, its hash falls in the
    /// current pass and its chain has room (else it stays shared, just not findable).
    fn list(&mut self, f: Frame) {
        if self.frames.flags(f) & IN_SHARE_TABLE == 0 {
            let h = self.hash(self.frames.data(f));
            if self.share.in_current_pass(h) && self.share.insert(h, ShareEntry::Shared(f)) {
                self.frames.set_flag(f, IN_SHARE_TABLE, true);
            }
        }
    }

    /// Takes a shared frame out of the share table (before it is freed or made private).
    fn unlist(&mut self, f: Frame) {
        if self.frames.flags(f) & IN_SHARE_TABLE != 0 {
            let h = self.hash(self.frames.data(f));
            let removed = self.share.remove(h, ShareEntry::Shared(f));
            debug_assert!(removed, "flagged frame {f:?} missing from the share table");
            self.frames.set_flag(f, IN_SHARE_TABLE, false);
        }
    }

    /// Releases whatever an entry holds (frame reference, blob and its reference, swap slot).
    fn release(&mut self, e: P2mEntry) {
        match e.state() {
            PageState::Unbacked | PageState::Zero => {}
            PageState::Private(f) | PageState::Shared(f) => self.put_frame(f),
            PageState::Patched(b) | PageState::Compressed(b) => {
                let meta = self.blobs.remove(&mut self.frames, b);
                if let Some(r) = meta.reference {
                    self.put_frame(r);
                }
            }
            PageState::Swapped(s) => self.swap.free(s),
        }
    }

    /// Decodes a page's content into `out` without changing any state.
    fn content(&self, vm: VmId, gfn: Gfn, out: &mut Page) -> Result<()> {
        match self.entry(vm, gfn).state() {
            PageState::Unbacked | PageState::Zero => out.fill(0),
            PageState::Private(f) | PageState::Shared(f) => {
                out.copy_from_slice(self.frames.data(f))
            }
            PageState::Patched(b) | PageState::Compressed(b) => {
                let meta = self.blobs.meta(&self.frames, b);
                let bytes = self.blobs.bytes(&self.frames, b);
                let reference = meta.reference.map(|r| self.frames.data(r));
                meta.kind
                    .decode(bytes, reference, out)
                    .map_err(|source| EngineError::Corrupt { vm, gfn, source })?;
            }
            PageState::Swapped(s) => self.swap.get(s, out).map_err(EngineError::SwapIo)?,
        }
        Ok(())
    }

    /// A frame for guest data, swapping pages out first if the host budget is reached.
    /// `exclude` is the page being served, never chosen as a victim.
    fn alloc_frame(&mut self, exclude: (VmId, Gfn)) -> Result<Frame> {
        if let Some(limit) = self.cfg.host_frames_limit {
            if self.frames.in_use() >= limit {
                let why = self.reclaim_to_budget(limit, Some(exclude))?;
                if self.frames.in_use() >= limit {
                    self.counters.out_of_memory += 1;
                    return Err(EngineError::OutOfHostMemory { limit, why });
                }
            }
        }
        self.frames.alloc().ok_or(EngineError::FramesExhausted)
    }

    /// The VM after `vm` in id order, wrapping around; the first VM for `None` or a VM
    /// that is gone.
    fn next_vm_after(&self, vm: Option<VmId>) -> Option<VmId> {
        use std::ops::Bound::{Excluded, Unbounded};
        vm.and_then(|v| {
            self.vms
                .range((Excluded(v), Unbounded))
                .next()
                .map(|(k, _)| *k)
        })
        .or_else(|| self.vms.keys().next().copied())
    }

    fn end_pass(&mut self) {
        for f in self.share.end_pass() {
            self.frames.set_flag(f, IN_SHARE_TABLE, false);
        }
        self.counters.passes += 1;
        if self.share.pass() == 0 {
            // A full cycle over every hash interval: rebuild the similarity index (DE §4.3).
            let pages = self.vms.values().map(|v| v.p2m.len() as u64).sum();
            self.sim.clear_for(pages);
            self.counters.cycles += 1;
        }
        self.pass_pending = self.vms.keys().copied().collect();
    }
}
