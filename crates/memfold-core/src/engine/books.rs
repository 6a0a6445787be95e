//! The books: what each mechanism saves, per guest and in total (DE Fig 9–11's
//! breakdown), the host budget and the swap file (DE §4.6), and how long stored pages
//! stay stored (DE Fig 4).

use serde::Serialize;

use super::{kept_index, Engine, SharingRanks};
use crate::blobs::{BlobHome, Kept};
use crate::ids::VmId;
use crate::p2m::PageState;
use crate::PAGE_SIZE;

const PAGE: u64 = PAGE_SIZE as u64;

/// One guest's counters. Pages are 4 KiB; "now" counts are pages in that state now, the
/// others cumulative since the guest attached.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct VmBooks {
    /// The operator opted the guest out ([`Engine::opt_out`]).
    pub opted_out: bool,
    /// Pages the agent could not take back after an opt-out (cumulative).
    pub take_back_refused: u64,
    /// Pages mapped onto pool frames now.
    pub shared_pages: u64,
    /// Of those, pages mapped onto the zero frame.
    pub zero_shared_pages: u64,
    /// Zero pages reclaimed now.
    pub zero_reclaimed_pages: u64,
    /// Pages hashed by the sharing scan.
    pub scanned_pages: u64,
    /// Its pages by category as its guest agent last reported them (PV §3.1, issue 17);
    /// `None` for a guest that reported nothing.
    pub categories: Option<crate::categories::CategoryCounts>,
    /// Category reports applied (cumulative).
    pub category_reports: u64,
    /// Category reports refused as not fitting its RAM (cumulative).
    pub category_refused: u64,
    /// Resident pages the sharing scan passed over as of a skipped category (slab by
    /// default; [`super::EngineConfig::guest_skip`]), as the guest
    /// reported them ([`super::EngineConfig::guest_categories`]), page-scans. Resident as
    /// the books know it where the scan passes pages before asking where data lies: a
    /// page never written, or discarded by the guest while private, is counted too.
    pub category_skipped: u64,
    /// Resident pages the sharing scan left out of a full scan as quiet (read before with
    /// nothing found; [`super::EngineConfig::quiet_scan_period`]), page-scans; resident
    /// as [`VmBooks::category_skipped`] counts it.
    pub skipped_pages: u64,
    /// Pages shared.
    pub shares: u64,
    /// Guest pages a disk read filled, as the block device reported them (Satori §4.1;
    /// [`super::Engine::read_landed`]), cumulative.
    pub read_landed: u64,
    /// Of [`VmBooks::shares`], the shares asked for the moment a disk read filled the page,
    /// not found by the scan (cumulative).
    pub read_shares: u64,
    /// Of [`VmBooks::read_shares`], pages a disk read asked to have filled from a frame
    /// holding its base block, and filled so, without the disk (Satori §5.2; cumulative).
    pub read_fills: u64,
    /// Landings passed over because the page is a read buffer the guest reuses: its last
    /// shares at read were undone by a write within `super::at_read::REUSED_WITHIN_US`
    /// (cumulative).
    pub read_backoffs: u64,
    /// Copy-on-write breaks.
    pub cow_breaks: u64,
    /// Zero pages reclaimed.
    pub reclaims: u64,
    /// Reclaimed pages the guest touched again, refilled.
    pub refills: u64,
    /// Free-page discard (issue 17, [`super::free_discard`]): pages asked to be watched
    /// (cumulative).
    pub free_watches: u64,
    /// Watched pages asked to be discarded, still free in a report sampled after the
    /// watch (cumulative).
    pub free_discard_asks: u64,
    /// Free pages discarded: holes now, zeros on their next access (cumulative; while
    /// untouched they count in `zero_reclaimed_pages`).
    pub free_discards: u64,
    /// Of `free_discards`, pages that were shared (Satori §4.3's no-copy-on-write, per
    /// page: the frame lost a holder and the guest's next write copies nothing).
    pub free_discards_shared: u64,
    /// Of `free_discards`, pages that were stored (patched, compressed or swapped): their
    /// blobs released.
    pub free_discards_stored: u64,
    /// Of `zero_reclaimed_pages`, free pages the guest reported, discarded and not
    /// touched since: what free-page discard saves now (issue 17). A memfoldd restart
    /// books those it finds as zero pages (the agent's list does not tell them apart).
    pub free_reclaimed_pages: u64,
    /// Pages taken back into guest RAM because the guest marked them never to be shared
    /// after they were shared or patched (Satori §4.3; [`super::never_share`];
    /// cumulative).
    pub never_share_takebacks: u64,
    /// Times the guest's store floor was raised: it waited on its agent over the wait
    /// target ([`super::wait_target`]; cumulative).
    pub store_floor_raised: u64,
    /// Its store floor now: idle clock scans a page needs before it is stored
    /// ([`super::wait_target`]).
    pub store_floor: u8,
    /// Its share of time waiting on its agent in the last window, basis points (1/100
    /// of a percent; `None`: no wait target, or no whole window yet).
    pub wait_share_bp: Option<u32>,
    /// Shared, reclaimed or stored pages the guest's VMM discarded (balloon, free page
    /// reporting): released without being brought back ([`super::Engine::discarded`]).
    pub discards: u64,
    /// No-copy-on-write (Satori §4.3): shared pages the guest freed and its VMM discarded
    /// (free page reporting, a balloon), dropped to holes instead of copied at the guest's
    /// next write — the CoW breaks' copies avoided. Part of [`VmBooks::discards`].
    pub cow_copies_avoided: u64,
    /// Private pages per NRU class C1..C4 in the clock's last full pass (DE §4.2).
    pub nru_pages: [u64; 4],
    /// Full clock passes over the guest.
    pub clock_passes: u64,
    /// Share or reclaim requests whose page had changed before the agent protected it.
    pub share_changed: u64,
    /// Pages the sharing scan left alone as C1 (recently modified).
    pub hot_skipped: u64,
    /// Share or reclaim requests the agent refused (VMA budget, not private).
    pub share_refused: u64,
    /// Pages stored as patches now (DE §3.2).
    pub patched_pages: u64,
    /// Pages shared without a mapping now: identical to a pool frame, punched out of guest
    /// RAM and kept as a reference to the frame (issue 19), so they cost QEMU no VMA.
    pub unmapped_pages: u64,
    /// Pages shared without a mapping (cumulative).
    pub unmapped_shares: u64,
    /// Of those, pages that were mapped onto their frame first and were turned into
    /// shares without a mapping under VMA pressure (cumulative; issue 19).
    pub unmaps: u64,
    /// Pages stored compressed now (DE §3.3).
    pub compressed_pages: u64,
    /// Pages patched.
    pub patches: u64,
    /// Pages compressed.
    pub compressions: u64,
    /// Stored pages the guest touched again, decoded back.
    pub unstashes: u64,
    /// Stash requests whose page had changed before the agent protected it.
    pub stash_changed: u64,
    /// Stash requests the agent refused.
    pub stash_refused: u64,
    /// Pages the agent paged out to the kernel's swap (zswap) and not yet seen back
    /// (issue 15, [`super::CompressBacking::Zswap`]); their host memory is the zswap
    /// pool's, which the kernel does not report per page.
    pub paged_out_pages: u64,
    /// Pages paged out to the kernel's swap (cumulative).
    pub page_outs: u64,
    /// Paged-out pages found in RAM again (the kernel's swap-ins, readahead's included) or
    /// discarded (cumulative).
    pub paged_ins: u64,
    /// Page-outs the agent answered with the page still in RAM (used since the clock armed
    /// it, mapped by another process, no swap on the host) or refused (cumulative).
    pub page_outs_kept: u64,
    /// Pages in the swap file now (DE §4.6).
    pub swapped_pages: u64,
    /// Pages swapped out.
    pub swap_outs: u64,
    /// Swapped pages the guest touched again, read back.
    pub swap_ins: u64,
    /// Of the swap-outs, stored pages moved from the store.
    pub swap_moves: u64,
    /// Requests lost with a connection (in doubt until the agent re-attached).
    pub lost: u64,
}

/// One guest in [`Books`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct VmReport {
    /// Its id.
    pub id: VmId,
    /// Guest name.
    pub name: String,
    /// QEMU's pid.
    pub pid: u32,
    /// Guest RAM, pages.
    pub pages: u64,
    /// Host memory the guest holds alone, bytes: its RAM and its store as allocated
    /// (holes take none; its domain's pool is not in it).
    pub host_bytes: u64,
    /// Whether its agent is connected.
    pub attached: bool,
    /// Its counters.
    pub books: VmBooks,
    /// Its shared pages by sharing rank, whence its sharing entitlement (Satori §4.2).
    pub sharing_ranks: SharingRanks,
}

/// Host pages saved, by mechanism. Pages are 4 KiB.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SavedBy {
    /// Sharing: guest pages mapped onto frames or shared without a mapping − frames held
    /// for them − the store slots of the unmapped ones.
    pub sharing: i64,
    /// Zero pages reclaimed (not counting `free`).
    pub zero: i64,
    /// Free pages the guest reported, discarded without a copy and not touched since
    /// (issue 17, PV §3.1: "free (guest-reported)").
    pub free: i64,
    /// Patching: patched pages − their store slots − frames held only as references.
    pub patching: i64,
    /// Compression: compressed pages − their store slots.
    pub compression: i64,
    /// Swap: pages in the swap file (on disk, no host memory).
    pub swap: i64,
    /// Store pages not covered by live slots (fragmentation; subtracted from the total).
    pub store_waste: i64,
}

/// The engine's own metadata by structure, bytes (docs/metadata.md; ESX §4.3 keeps it
/// under 0.5% of memory).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MetadataBytes {
    /// Per guest page: P2M entries, the clock's bytes and hints, the scan's ages, the
    /// categories, the small per-guest tables.
    pub pages: u64,
    /// The pools' frame books.
    pub frames: u64,
    /// The share tables: shared frames and the current scan's hints (ESX §4.3).
    pub share_table: u64,
    /// The similarity indexes (DE §3.2).
    pub similarity: u64,
    /// The blob table: one record a stored page.
    pub blobs: u64,
}

impl MetadataBytes {
    /// All of it, bytes.
    pub fn total(&self) -> u64 {
        self.pages + self.frames + self.share_table + self.similarity + self.blobs
    }
}

/// The host budget and the swap file (DE §4.6). Pages are 4 KiB.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SwapBooks {
    /// The budget, pages; `None`: no budget.
    pub budget_pages: Option<u64>,
    /// Host pages the guests' RAM used at the last check (memfds, pool, store).
    pub host_used_pages: u64,
    /// Guest pages in the swap file now.
    pub swapped_pages: u64,
    /// Bytes of swap slots in use.
    pub slot_bytes: u64,
    /// Swap file pages (chunks) in use.
    pub file_pages: u64,
    /// Swap file capacity, pages.
    pub capacity_pages: u64,
    /// Swap-outs refused because the swap file was full (cumulative).
    pub full: u64,
    /// Pages still to swap out to get under the budget.
    pub wanted_pages: u64,
    /// Write-backs of the swap file that failed (cumulative).
    pub sync_errors: u64,
}

/// The lifetime thresholds of [`LifetimeBooks`], seconds.
pub const LIFETIME_MARKS_S: [u64; 9] = [1, 2, 5, 10, 20, 30, 60, 120, 300];

/// How long stored pages stayed stored before the guest touched them (DE Figure 4).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LifetimeBooks {
    /// Stored pages the guests touched again.
    pub restored: u64,
    /// Pages stored now.
    pub stored_now: u64,
    /// (seconds, fraction of the restored pages restored sooner), at [`LIFETIME_MARKS_S`].
    pub restored_before: Vec<(f64, f64)>,
    /// Fraction of all pages ever stored that lived at least 10 s, counting pages still
    /// stored for 10 s or more (DE Fig 4's "~80% live ≥ 10 s").
    pub lived_10s: f64,
}

/// Restored pages by lifetime.
#[derive(Default)]
pub(crate) struct Lifetimes {
    /// Restored pages that lived under each mark.
    below: [u64; LIFETIME_MARKS_S.len()],
    restored: u64,
}

impl Lifetimes {
    pub(crate) fn record(&mut self, lived_us: u64) {
        self.restored += 1;
        for (n, &s) in self.below.iter_mut().zip(&LIFETIME_MARKS_S) {
            if lived_us < s * 1_000_000 {
                *n += 1;
            }
        }
    }
}

/// Engine-wide books besides the guests'.
pub(crate) struct EngineBooks {
    /// Slot bytes by what they keep: [patches, compressed pages, swap, unmapped shares].
    pub(crate) slot_bytes: [u64; 4],
    pub(crate) swap_sync_errors: u64,
    /// Frames the pool could not take (host out of memory).
    pub(crate) pool_errors: u64,
    pub(crate) blob_write_errors: u64,
    /// Stored blobs a move to swap could not read or decode (left where they are).
    pub(crate) blob_read_errors: u64,
    pub(crate) lifetimes: Lifetimes,
    /// Encode times, ns: [patch encode per candidate, compress per page].
    encode_ns: [hdrhistogram::Histogram<u64>; 2],
    /// Shares made at read: from the page's landing to its share answered, µs.
    read_share_us: hdrhistogram::Histogram<u64>,
    /// Base blocks indexed as held by a frame, checked against the base (Satori §5.2).
    pub(crate) blocks_indexed: u64,
    /// Pool frames sent to the kernel's swap (cumulative; `kernel_swap.rs`).
    pub(crate) frame_page_outs: u64,
}

impl EngineBooks {
    pub(crate) fn new() -> Self {
        let h = || {
            hdrhistogram::Histogram::new_with_bounds(1, 60_000_000_000, 2).expect("valid bounds")
        };
        EngineBooks {
            slot_bytes: [0; 4],
            swap_sync_errors: 0,
            pool_errors: 0,
            blob_write_errors: 0,
            blob_read_errors: 0,
            lifetimes: Lifetimes::default(),
            encode_ns: [h(), h()],
            read_share_us: h(),
            blocks_indexed: 0,
            frame_page_outs: 0,
        }
    }

    /// Counts a pool error; returns the count when it is a power of two, the times to log
    /// it (a failing pool must not flood the log).
    pub(crate) fn pool_error(&mut self) -> Option<u64> {
        self.pool_errors += 1;
        self.pool_errors
            .is_power_of_two()
            .then_some(self.pool_errors)
    }

    pub(crate) fn record_read_share(&mut self, us: u64) {
        let _ = self.read_share_us.record(us.max(1));
    }

    pub(crate) fn record_encode(&mut self, which: usize, ns: u64) {
        let _ = self.encode_ns[which].record(ns.max(1));
    }
}

/// The host budget's state.
pub(crate) struct BudgetState {
    pub(crate) host_used_pages: u64,
    /// Bytes still to swap out to get under the budget (the check's estimate).
    pub(crate) swap_wanted: u64,
    /// Swap-outs refused because the swap file was full.
    pub(crate) swap_full: u64,
    checked_us: u64,
    /// After a swap file write or write-back failed: no swap-outs before this, µs.
    swap_failed_until_us: u64,
    /// The last back-off, µs (0: none since a quiet one as long).
    swap_backoff_us: u64,
}

/// The first back-off from a swap file that failed a write or a write-back, µs; doubled
/// at each failure up to [`SWAP_BACKOFF_MAX_US`].
const SWAP_BACKOFF_MIN_US: u64 = 1_000_000;
/// The longest back-off from a failing swap file, µs.
const SWAP_BACKOFF_MAX_US: u64 = 64_000_000;

impl BudgetState {
    pub(crate) fn new(now_us: u64) -> Self {
        BudgetState {
            host_used_pages: 0,
            swap_wanted: 0,
            swap_full: 0,
            checked_us: now_us,
            swap_failed_until_us: 0,
            swap_backoff_us: 0,
        }
    }

    /// A swap file write or write-back failed at `now_us`: no swap-outs for a back-off of
    /// 1 s, doubling at each failure up to 64 s (a failing `fdatasync` may block
    /// memfoldd's loop as long as the disk takes; cold pages go to the store meanwhile).
    pub(crate) fn swap_failed(&mut self, now_us: u64) {
        self.swap_backoff_us =
            (self.swap_backoff_us * 2).clamp(SWAP_BACKOFF_MIN_US, SWAP_BACKOFF_MAX_US);
        self.swap_failed_until_us = now_us + self.swap_backoff_us;
        self.swap_wanted = 0;
    }
}

/// Everything the engine knows, in numbers: what memfoldd exports.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Books {
    /// Seconds since the engine started.
    pub uptime_s: f64,
    /// Full sharing scans started.
    pub full_scans: u64,
    /// Pool frames in use.
    pub frames: u64,
    /// Guest pages mapped onto pool frames (sum of sharing ranks).
    pub mapped_pages: u64,
    /// Zero pages reclaimed now.
    pub zero_reclaimed_pages: u64,
    /// Host pages saved: mapped pages − frames + reclaimed zero pages + stored pages −
    /// store pages.
    pub saved_pages: i64,
    /// The same, by mechanism.
    pub saved_by: SavedBy,
    /// Pages stored as patches now.
    pub patched_pages: u64,
    /// Pages shared without a mapping now (punched, identical to a pool frame).
    pub unmapped_pages: u64,
    /// Pages stored compressed now.
    pub compressed_pages: u64,
    /// Store pages (chunks) in use.
    pub store_pages: u64,
    /// Pool frames held only as patch references.
    pub reference_frames: u64,
    /// Pool pages in the kernel's swap now (issue 15's zswap backing: the frames only
    /// patches hold that the engine paged out, and any the kernel swapped on its own; as
    /// the pools' memfds say, `Backing::swapped_bytes`).
    pub frames_paged_out: u64,
    /// Pool frames sent to the kernel's swap (cumulative).
    pub frame_page_outs: u64,
    /// Budget and swap file.
    pub swap: SwapBooks,
    /// Stored page lifetimes (pages kept as blobs: a page shared without a mapping
    /// keeps no store time, `super::unmapped::UnmappedAges`).
    pub lifetime: LifetimeBooks,
    /// The policy's name.
    pub policy: String,
    /// Share-table entries.
    pub table_entries: u64,
    /// Whether a domain's pool was adopted from a previous memfoldd.
    pub adopted_pool: bool,
    /// Sharing domains now, each with a pool of its own.
    pub domains: u64,
    /// Bytes the backings hold against the books: [pools, stores, swap files] as
    /// (held, booked) — a leak check (held past booked is memory nothing accounts for).
    pub held: [(u64, u64); 3],
    /// Frames the pool could not take (host out of memory; cumulative).
    pub pool_errors: u64,
    /// Blobs a store or swap file could not take (host out of memory, disk full, EIO,
    /// or every blob id live; cumulative): each page stayed in guest RAM.
    pub blob_write_errors: u64,
    /// Bytes of the engine's own metadata: P2M entries, clock bytes and per-page hints,
    /// the pool's books, the share table, the similarity index, the blob table.
    pub metadata_bytes: u64,
    /// The same by structure.
    pub metadata_by: MetadataBytes,
    /// Encode times as (ns, count) pairs: [patch encode per candidate, compress].
    pub encode_ns: [Vec<(u64, u64)>; 2],
    /// Shares made at disk read (Satori §4.1), each from the page's landing to its share
    /// answered, µs, as (value, count) pairs.
    pub read_share_us: Vec<(u64, u64)>,
    /// Base blocks indexed as held by a frame since start (Satori §5.2, cumulative).
    pub blocks_indexed: u64,
    /// Base blocks indexed now, all domains.
    pub blocks_held: u64,
    /// Per guest, by id.
    pub vms: Vec<VmReport>,
}

impl Engine {
    /// With a host budget, measures (at most every 250 ms) the host memory the guests'
    /// RAM uses — their memfds, the pool and the store, holes taking none — and sets how
    /// many bytes the clock should swap out to bring it 2% under the budget (DE §4.6), net
    /// of swap-outs already under way.
    pub fn check_budget(&mut self) {
        let Some(budget) = self.cfg.host_budget else {
            return;
        };
        let now = self.now_us();
        if now.saturating_sub(self.budget.checked_us) < 250_000 {
            return;
        }
        self.budget.checked_us = now;
        let used: u64 = self
            .vms
            .values()
            // A paged-out page (or pool frame) is allocated to its memfd but not in RAM;
            // the zswap pool that holds it is not counted (the kernel gives no per-guest
            // figure): the budget errs toward swapping less (kernel_swap.rs).
            .map(|v| {
                (v.ram.allocated_bytes() + v.store.allocated_bytes())
                    .saturating_sub(v.books.paged_out_pages * PAGE)
            })
            .sum::<u64>()
            + self
                .domains
                .values()
                .map(|d| {
                    d.pool
                        .allocated_bytes()
                        .saturating_sub(d.pool.swapped_bytes())
                })
                .sum::<u64>();
        self.budget.host_used_pages = used / PAGE;
        let in_flight: u64 = self
            .blobs
            .iter()
            .filter(|(id, b)| {
                b.home() == BlobHome::Swap
                    && self.vms.get(&b.vm).is_some_and(|v| {
                        matches!(v.state(b.gfn), PageState::Stashing(x) | PageState::Moving(x) if x == *id)
                    })
            })
            .map(|(id, b)| match (self.blobs.replaces(id), self.vms[&b.vm].space(b.home())) {
                (Some(_), Some(swap)) => swap.slot(b.slot).size as u64,
                _ => PAGE,
            })
            .sum();
        let low_water = budget / 100 * 98;
        self.budget.swap_wanted = used.saturating_sub(low_water).saturating_sub(in_flight);
        let b = &mut self.budget;
        if now < b.swap_failed_until_us {
            b.swap_wanted = 0;
        } else if now >= b.swap_failed_until_us + b.swap_backoff_us {
            // A quiet spell as long as the last back-off: the next starts afresh.
            b.swap_backoff_us = 0;
        }
    }

    /// The books now.
    pub fn books(&self) -> Books {
        let mut ranks = self.all_sharing_ranks();
        let vms: Vec<VmReport> = self
            .vms
            .iter()
            .map(|(id, v)| VmReport {
                id: *id,
                name: v.name.clone(),
                pid: v.pid,
                pages: v.pages() as u64,
                host_bytes: v.ram.allocated_bytes() + v.store.allocated_bytes(),
                attached: v.attached,
                books: VmBooks {
                    store_floor: v.wait.floor,
                    wait_share_bp: v.wait.share_pct.map(|p| (p * 100.0).round() as u32),
                    ..v.books.clone()
                },
                sharing_ranks: ranks.remove(id).expect("a guest of the engine"),
            })
            .collect();
        let sum = |f: fn(&VmBooks) -> u64| vms.iter().map(|v| f(&v.books)).sum::<u64>();
        let mapped = sum(|b| b.shared_pages);
        let reclaimed = sum(|b| b.zero_reclaimed_pages);
        let free = sum(|b| b.free_reclaimed_pages);
        let patched = sum(|b| b.patched_pages);
        let unmapped = sum(|b| b.unmapped_pages);
        let compressed = sum(|b| b.compressed_pages);
        let swapped = sum(|b| b.swapped_pages);
        let frames: u64 = self
            .domains
            .values()
            .map(|d| d.frames.in_use() as u64)
            .sum();
        let reference_frames: u64 = self
            .domains
            .values()
            .map(|d| d.frames.reference_only())
            .sum();
        // Frames held only as references, some of them by pages shared without a mapping:
        // those are sharing's frames, the others patching's.
        let unmapped_frames = self.unmapped_reference_frames();
        let store_pages: u64 = self.vms.values().map(|v| v.store.stats().pages).sum();
        let [patch_bytes, compressed_bytes, swap_bytes, unmapped_bytes] = self.books.slot_bytes;
        let page = PAGE as i64;
        let saved_by = SavedBy {
            sharing: (mapped + unmapped) as i64
                - (frames - reference_frames + unmapped_frames) as i64
                - unmapped_bytes as i64 / page,
            zero: (reclaimed - free) as i64,
            free: free as i64,
            patching: patched as i64
                - patch_bytes as i64 / page
                - (reference_frames - unmapped_frames) as i64,
            compression: compressed as i64 - compressed_bytes as i64 / page,
            swap: swapped as i64,
            store_waste: store_pages as i64
                - (patch_bytes + compressed_bytes + unmapped_bytes) as i64 / page,
        };
        let stored_now: Vec<u64> = self
            .blobs
            .iter()
            .filter(|(id, b)| {
                self.vms
                    .get(&b.vm)
                    .is_some_and(|v| v.state(b.gfn) == PageState::Stored(*id))
            })
            .map(|(_, b)| b.since_us())
            .collect();
        let now = self.now_us();
        let l = &self.books.lifetimes;
        let old_now = stored_now
            .iter()
            .filter(|&&t| now.saturating_sub(t) >= 10_000_000)
            .count() as u64;
        let total = l.restored + stored_now.len() as u64;
        let frac = |n: u64, d: u64| if d == 0 { 0.0 } else { n as f64 / d as f64 };
        let lifetime = LifetimeBooks {
            restored: l.restored,
            stored_now: stored_now.len() as u64,
            restored_before: LIFETIME_MARKS_S
                .iter()
                .zip(&l.below)
                .map(|(&s, &n)| (s as f64, frac(n, l.restored)))
                .collect(),
            lived_10s: frac(l.restored - l.below[3] + old_now, total),
        };
        let pairs = |h: &hdrhistogram::Histogram<u64>| {
            h.iter_recorded()
                .map(|v| (v.value_iterated_to(), v.count_at_value()))
                .collect()
        };
        let metadata_by = self.metadata_by();
        Books {
            uptime_s: now.saturating_sub(self.started_us) as f64 / 1e6,
            full_scans: self.scan.full_scans,
            frames,
            mapped_pages: mapped,
            zero_reclaimed_pages: reclaimed,
            saved_pages: mapped as i64 - frames as i64
                + reclaimed as i64
                + (patched + unmapped + compressed + swapped) as i64
                - store_pages as i64,
            saved_by,
            patched_pages: patched,
            unmapped_pages: unmapped,
            compressed_pages: compressed,
            store_pages,
            reference_frames,
            frames_paged_out: self
                .domains
                .values()
                .map(|d| d.pool.swapped_bytes() / PAGE)
                .sum(),
            frame_page_outs: self.books.frame_page_outs,
            swap: SwapBooks {
                budget_pages: self.cfg.host_budget.map(|b| b / PAGE),
                host_used_pages: self.budget.host_used_pages,
                swapped_pages: swapped,
                slot_bytes: swap_bytes,
                file_pages: self
                    .vms
                    .values()
                    .filter_map(|v| v.swap.as_ref())
                    .map(|s| s.stats().pages)
                    .sum(),
                capacity_pages: if self.vms.values().any(|v| v.swap.is_some()) {
                    self.swap_capacity / PAGE
                } else {
                    0
                },
                full: self.budget.swap_full,
                wanted_pages: self.budget.swap_wanted / PAGE,
                sync_errors: self.books.swap_sync_errors,
            },
            lifetime,
            policy: self.cfg.policy.name.to_string(),
            table_entries: self.domains.values().map(|d| d.share.len() as u64).sum(),
            adopted_pool: self.domains.values().any(|d| d.adopted),
            domains: self.domains.len() as u64,
            held: self.held_bytes(),
            pool_errors: self.books.pool_errors,
            blob_write_errors: self.books.blob_write_errors,
            metadata_bytes: metadata_by.total(),
            metadata_by,
            encode_ns: [
                pairs(&self.books.encode_ns[0]),
                pairs(&self.books.encode_ns[1]),
            ],
            read_share_us: pairs(&self.books.read_share_us),
            blocks_indexed: self.books.blocks_indexed,
            blocks_held: self.fills.index.values().map(|i| i.len() as u64).sum(),
            vms,
        }
    }

    /// [pools, stores, swap files]: (bytes their backings hold, bytes the books hold).
    fn held_bytes(&self) -> [(u64, u64); 3] {
        let pool = self.domains.values().fold((0, 0), |(h, b), d| {
            (
                h + d.pool.allocated_bytes(),
                b + d.frames.in_use() as u64 * PAGE,
            )
        });
        let spaces = |swap: bool| {
            self.vms
                .values()
                .filter_map(|v| {
                    if swap {
                        v.swap.as_ref()
                    } else {
                        Some(&v.store)
                    }
                })
                .fold((0, 0), |(h, b), s| {
                    (h + s.allocated_bytes(), b + s.stats().pages * PAGE)
                })
        };
        [pool, spaces(false), spaces(true)]
    }

    /// Bytes of the engine's own metadata (see [`Books::metadata_bytes`]).
    pub fn metadata_bytes(&self) -> u64 {
        self.metadata_by().total()
    }

    /// The engine's own metadata by structure, bytes (docs/metadata.md; issue 19).
    pub fn metadata_by(&self) -> MetadataBytes {
        let per_vm: usize = self
            .vms
            .values()
            .map(|v| {
                v.p2m.capacity() * 4
                    + v.p2m.len() * 2
                    + v.hints.bytes()
                    + v.categories.as_ref().map_or(0, |m| m.bytes())
                    + crate::share::hashbrown_bytes(v.unmapping.capacity(), 4)
                    + crate::share::hashbrown_bytes(v.early.capacity(), 16)
                    + crate::share::hashbrown_bytes(v.read_sharing.capacity(), 16)
                    + crate::share::hashbrown_bytes(v.read_shared_at.capacity(), 16)
                    + crate::share::hashbrown_bytes(v.read_backoff.capacity(), 24)
            })
            .sum();
        let sum = |f: &dyn Fn(&super::Domain) -> usize| -> u64 {
            self.domains.values().map(|d| f(d) as u64).sum()
        };
        MetadataBytes {
            pages: per_vm as u64,
            frames: sum(&|d| d.frames.metadata_bytes()),
            share_table: sum(&|d| d.share.metadata_bytes())
                + self
                    .kept_hints
                    .values()
                    .map(|r| (r.capacity() * std::mem::size_of::<(u64, crate::ids::Gpn)>()) as u64)
                    .sum::<u64>(),
            similarity: sum(&|d| d.similar.metadata_bytes()),
            blobs: self.blobs.metadata_bytes() as u64,
        }
    }

    /// Slot bytes the books hold for `k`.
    pub(crate) fn slot_bytes_of(&self, k: Kept) -> u64 {
        self.books.slot_bytes[kept_index(k)]
    }
}
