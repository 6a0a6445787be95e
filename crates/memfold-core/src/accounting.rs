//! The books: savings by mechanism and by VM, page and frame counts, metadata cost and
//! operation counters.
//!
//! Savings follow Difference Engine §3.2's definition: the memory needed to store shared,
//! patched and compressed pages is counted against what they save. With B the guest pages
//! the VMs have backed (written at least once) and U the host frames the engine holds,
//!
//! ```text
//! saved = B - U
//!       = zero + sharing + patching + compression + swap + blob_fragmentation
//! zero        = zero-reclaimed pages
//! sharing     = shared mappings - distinct shared frames
//! patching    = patched pages - their slot bytes - frames kept only as references
//! compression = compressed pages - their slot bytes
//! swap        = swapped pages (held on disk, not in memory)
//! blob_fragmentation = -(blob frames' bytes not in a live slot)
//! ```
//!
//! all in bytes. The engine's metadata is reported beside it ([`MetadataUsage`]), not in U.

use serde::Serialize;

use crate::blobstore::{BlobKind, BlobStoreStats};
use crate::engine::Engine;
use crate::swap::SwapStats;
use crate::types::{PageState, VmId, PAGE_SIZE};

const PAGE: i64 = PAGE_SIZE as i64;

/// Counts of operations since the engine was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counters {
    /// Pages the clock scanned.
    pub pages_scanned: u64,
    /// Pages mapped onto a shared frame (share-table matches and identical patch candidates).
    pub shares: u64,
    /// Zero pages reclaimed.
    pub zero_reclaims: u64,
    /// Hints entered in the share table.
    pub hints: u64,
    /// Hash matches whose bytes differed (never shared).
    pub hash_false_matches: u64,
    /// Pages ineligible because their hash chain was full.
    pub share_chain_full: u64,
    /// Writes to shared pages.
    pub cow_breaks: u64,
    /// Of those, the last sharer taking the frame back without a copy.
    pub cow_reuses: u64,
    /// Pages patched.
    pub patches: u64,
    /// Patch attempts whose best patch was over the cut-off.
    pub patch_rejected: u64,
    /// Patch attempts with no candidate.
    pub patch_no_candidate: u64,
    /// Faults on patched pages.
    pub unpatches: u64,
    /// Pages compressed.
    pub compressions: u64,
    /// Compression attempts over the cut-off.
    pub compress_rejected: u64,
    /// Faults on compressed pages.
    pub decompressions: u64,
    /// Pages swapped out.
    pub swap_outs: u64,
    /// Faults on swapped pages.
    pub swap_ins: u64,
    /// Swap-outs refused because the swap file was full.
    pub swap_full: u64,
    /// Swap device errors.
    pub swap_io_errors: u64,
    /// Allocations refused for lack of host memory.
    pub out_of_memory: u64,
    /// Swap-ins kept over the host budget because neither a victim nor the page itself
    /// could be written to swap (guest data is never dropped).
    pub budget_overruns: u64,
    /// First writes to zero or never-written pages.
    pub zero_fills: u64,
    /// Guest reads through the API.
    pub reads: u64,
    /// Guest writes through the API.
    pub writes: u64,
    /// Share-table passes completed.
    pub passes: u64,
    /// Clock cycles completed (similarity index rebuilt).
    pub cycles: u64,
}

/// Guest pages by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PageCounts {
    /// Never written or discarded.
    pub unbacked: u64,
    /// Zero pages reclaimed.
    pub zero: u64,
    /// Private frames.
    pub private: u64,
    /// Mappings of shared frames.
    pub shared: u64,
    /// Patched pages.
    pub patched: u64,
    /// Compressed pages.
    pub compressed: u64,
    /// Swapped pages.
    pub swapped: u64,
}

/// Host frames held, by use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FrameCounts {
    /// All frames in use (= private + shared + reference_only + blob).
    pub in_use: u64,
    /// Frames mapped by one private page.
    pub private: u64,
    /// Distinct frames with at least one shared mapping.
    pub shared: u64,
    /// Frames no page maps, kept because patches use them as reference.
    pub reference_only: u64,
    /// Frames holding patches and compressed pages.
    pub blob: u64,
}

/// Savings by mechanism, bytes (see the module documentation for the definitions).
/// Per VM, sharing and reference costs are split evenly among the pages using a frame,
/// so figures are fractional.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Savings {
    /// Zero pages reclaimed.
    pub zero: f64,
    /// Identical pages shared.
    pub sharing: f64,
    /// Similar pages patched, net of patch slots and reference-only frames.
    pub patching: f64,
    /// Pages compressed, net of their slots.
    pub compression: f64,
    /// Pages on swap.
    pub swap: f64,
    /// Unused space in blob frames (negative).
    pub blob_fragmentation: f64,
}

impl std::ops::AddAssign for PageCounts {
    fn add_assign(&mut self, o: PageCounts) {
        self.unbacked += o.unbacked;
        self.zero += o.zero;
        self.private += o.private;
        self.shared += o.shared;
        self.patched += o.patched;
        self.compressed += o.compressed;
        self.swapped += o.swapped;
    }
}

impl std::ops::AddAssign for Savings {
    fn add_assign(&mut self, o: Savings) {
        self.zero += o.zero;
        self.sharing += o.sharing;
        self.patching += o.patching;
        self.compression += o.compression;
        self.swap += o.swap;
        self.blob_fragmentation += o.blob_fragmentation;
    }
}

impl Savings {
    /// Sum of all mechanisms, bytes.
    pub fn total(&self) -> f64 {
        self.zero
            + self.sharing
            + self.patching
            + self.compression
            + self.swap
            + self.blob_fragmentation
    }
}

/// One VM's share of the books.
#[derive(Clone, Debug, Serialize)]
pub struct VmAccounting {
    /// The VM.
    pub vm: VmId,
    /// Its size, pages.
    pub guest_pages: u64,
    /// Its pages by state.
    pub pages: PageCounts,
    /// Host memory it would use without memfold: backed pages × 4096, bytes.
    pub baseline_bytes: u64,
    /// Savings attributed to it, bytes.
    pub saved: Savings,
}

/// Engine metadata, bytes, and its ratio to managed guest memory (ESX §4.3 keeps page
/// sharing metadata under 0.5% of memory).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct MetadataUsage {
    /// P2M maps, 4 bytes a guest page.
    pub p2m: u64,
    /// Clock bytes, 1 a guest page.
    pub clock: u64,
    /// Frame counts, flags, free list.
    pub frames: u64,
    /// Share table.
    pub share_table: u64,
    /// Similarity index.
    pub similarity: u64,
    /// Blob records and chunk map.
    pub blob_store: u64,
    /// Swap slot bitmap.
    pub swap: u64,
    /// Sum.
    pub total: u64,
    /// Managed guest memory (all VMs' sizes), bytes.
    pub managed_bytes: u64,
    /// total / managed_bytes.
    pub fraction: f64,
}

/// The whole books at one instant.
#[derive(Clone, Debug, Serialize)]
pub struct Accounting {
    /// Sum of VM sizes, pages.
    pub guest_pages: u64,
    /// Pages by state, all VMs.
    pub pages: PageCounts,
    /// Frames by use.
    pub frames: FrameCounts,
    /// Host memory the guests would use without memfold (backed pages × 4096), bytes.
    pub baseline_bytes: u64,
    /// Host memory the engine holds for guest data (frames in use × 4096), bytes.
    pub host_bytes: u64,
    /// baseline − host, bytes (exact integer).
    pub saved_bytes: i64,
    /// saved_bytes by mechanism.
    pub saved: Savings,
    /// Blob store occupancy.
    pub blobs: BlobStoreStats,
    /// Swap occupancy.
    pub swap: SwapStats,
    /// Engine metadata.
    pub metadata: MetadataUsage,
    /// Per VM.
    pub per_vm: Vec<VmAccounting>,
}

impl Accounting {
    /// saved / baseline (0 with no backed page).
    pub fn saved_fraction(&self) -> f64 {
        if self.baseline_bytes == 0 {
            0.0
        } else {
            self.saved_bytes as f64 / self.baseline_bytes as f64
        }
    }
}

impl Engine {
    /// Computes the books by walking every P2M map: O(guest pages), for reports, not hot
    /// paths.
    pub fn accounting(&self) -> Accounting {
        let nframes = self
            .frames
            .allocated()
            .last()
            .map_or(0, |f| f.0 as usize + 1);
        // Per frame: shared mappings, private mappings, patch references.
        let mut shared_maps = vec![0u32; nframes];
        let mut private_maps = vec![0u8; nframes];
        let mut patch_refs = vec![0u32; nframes];
        for v in self.vms.values() {
            for e in &v.p2m {
                match e.state() {
                    PageState::Shared(f) => shared_maps[f.0 as usize] += 1,
                    PageState::Private(f) => private_maps[f.0 as usize] = 1,
                    PageState::Patched(b) => {
                        let r = self
                            .blobs
                            .meta(&self.frames, b)
                            .reference
                            .expect("patch has a reference");
                        patch_refs[r.0 as usize] += 1;
                    }
                    _ => {}
                }
            }
        }
        let blobs = self.blobs.stats();
        let mut frames = FrameCounts {
            in_use: self.frames.in_use() as u64,
            blob: blobs.frames as u64,
            ..Default::default()
        };
        for i in 0..nframes {
            if shared_maps[i] > 0 {
                frames.shared += 1;
            } else if private_maps[i] > 0 {
                frames.private += 1;
            } else if patch_refs[i] > 0 {
                frames.reference_only += 1;
            }
        }
        // Blob fragmentation is split among blobs evenly.
        let frag_per_blob = if blobs.blobs == 0 {
            0.0
        } else {
            -(blobs.free_slot_bytes as f64) / blobs.blobs as f64
        };

        let mut total = PageCounts::default();
        let mut per_vm = Vec::with_capacity(self.vms.len());
        let mut saved = Savings::default();
        for (&id, v) in &self.vms {
            let mut pc = PageCounts::default();
            let mut s = Savings::default();
            for e in &v.p2m {
                match e.state() {
                    PageState::Unbacked => pc.unbacked += 1,
                    PageState::Zero => {
                        pc.zero += 1;
                        s.zero += PAGE as f64;
                    }
                    PageState::Private(_) => pc.private += 1,
                    PageState::Shared(f) => {
                        pc.shared += 1;
                        // m mappings of one frame save m-1 pages, (m-1)/m each.
                        let m = shared_maps[f.0 as usize] as f64;
                        s.sharing += PAGE as f64 * (m - 1.0) / m;
                    }
                    PageState::Patched(b) => {
                        pc.patched += 1;
                        let r = self
                            .blobs
                            .meta(&self.frames, b)
                            .reference
                            .expect("patch has a reference")
                            .0 as usize;
                        let ref_cost = if shared_maps[r] == 0 && private_maps[r] == 0 {
                            PAGE as f64 / patch_refs[r] as f64
                        } else {
                            0.0
                        };
                        s.patching += PAGE as f64
                            - self.blobs.slot_bytes_of(&self.frames, b) as f64
                            - ref_cost;
                        s.blob_fragmentation += frag_per_blob;
                    }
                    PageState::Compressed(b) => {
                        pc.compressed += 1;
                        s.compression +=
                            PAGE as f64 - self.blobs.slot_bytes_of(&self.frames, b) as f64;
                        s.blob_fragmentation += frag_per_blob;
                    }
                    PageState::Swapped(_) => {
                        pc.swapped += 1;
                        s.swap += PAGE as f64;
                    }
                }
            }
            let backed = v.p2m.len() as u64 - pc.unbacked;
            total += pc;
            saved += s;
            per_vm.push(VmAccounting {
                vm: id,
                guest_pages: v.p2m.len() as u64,
                pages: pc,
                baseline_bytes: backed * PAGE as u64,
                saved: s,
            });
        }
        let guest_pages: u64 = self.vms.values().map(|v| v.p2m.len() as u64).sum();
        let baseline_bytes = (guest_pages - total.unbacked) * PAGE as u64;
        let host_bytes = frames.in_use * PAGE as u64;
        // Exact integer totals (the per-VM fractions add up to these up to rounding).
        let slot_patch: i64 = self
            .blobs
            .live_ids()
            .filter(|&b| matches!(self.blobs.meta(&self.frames, b).kind, BlobKind::Patch(_)))
            .map(|b| self.blobs.slot_bytes_of(&self.frames, b) as i64)
            .sum();
        let exact = Savings {
            zero: (total.zero as i64 * PAGE) as f64,
            sharing: ((total.shared as i64 - frames.shared as i64) * PAGE) as f64,
            patching: (total.patched as i64 * PAGE
                - slot_patch
                - frames.reference_only as i64 * PAGE) as f64,
            compression: (total.compressed as i64 * PAGE - (blobs.slot_bytes as i64 - slot_patch))
                as f64,
            swap: (total.swapped as i64 * PAGE) as f64,
            blob_fragmentation: -(blobs.free_slot_bytes as f64),
        };
        debug_assert!(
            (exact.total() - saved.total()).abs() < 1.0 + 1e-6 * exact.total().abs(),
            "{exact:?} vs {saved:?}"
        );
        Accounting {
            guest_pages,
            pages: total,
            frames,
            baseline_bytes,
            host_bytes,
            saved_bytes: baseline_bytes as i64 - host_bytes as i64,
            saved: exact,
            blobs,
            swap: self.swap.stats(),
            metadata: self.metadata(),
            per_vm,
        }
    }

    /// The engine's metadata, bytes, by structure.
    pub fn metadata(&self) -> MetadataUsage {
        let mut m = MetadataUsage {
            p2m: self
                .vms
                .values()
                .map(|v| (v.p2m.capacity() * 4) as u64)
                .sum(),
            clock: self.vms.values().map(|v| v.clock.capacity() as u64).sum(),
            frames: self.frames.metadata_bytes() as u64,
            share_table: self.share.metadata_bytes() as u64,
            similarity: self.sim.metadata_bytes() as u64,
            blob_store: self.blobs.metadata_bytes() as u64,
            swap: self.swap.metadata_bytes() as u64,
            ..Default::default()
        };
        m.total = m.p2m + m.clock + m.frames + m.share_table + m.similarity + m.blob_store + m.swap;
        m.managed_bytes = self
            .vms
            .values()
            .map(|v| v.p2m.len() as u64 * PAGE as u64)
            .sum();
        m.fraction = if m.managed_bytes == 0 {
            0.0
        } else {
            m.total as f64 / m.managed_bytes as f64
        };
        m
    }
}
