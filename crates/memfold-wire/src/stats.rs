//! memfoldd's statistics: every counter, per guest and in total, as a client gets them
//! ([`crate::ToClient::Stats`]); [`crate::metrics`] exposes them to Prometheus.

use serde::{Deserialize, Serialize};

use crate::latency::{LatencySummary, OpBuckets, OpLatency};

/// Latencies of the live operations, as the agents timed them (µs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OpLatencies {
    /// Share, per page.
    pub share: LatencySummary,
    /// CoW break: fault read to writer woken.
    pub cow_break: LatencySummary,
    /// Missing-fault service: fault read to thread woken.
    pub fault: LatencySummary,
    /// Zero-page reclaim, per page.
    pub reclaim: LatencySummary,
    /// The clock's R/M tracking: minor (R) and write-protect (M) fault service.
    pub track: LatencySummary,
    /// Stash in the agent (decode check, punch), per page.
    pub stash: LatencySummary,
    /// Missing fault on a stashed page: decode and install.
    pub unstash: LatencySummary,
    /// Patch encoding in memfoldd, per candidate tried.
    pub patch_encode: LatencySummary,
    /// Compression in memfoldd, per page.
    pub compress: LatencySummary,
    /// A share made at disk read (Satori §4.1), in memfoldd: from the block device's
    /// report of the page to the agent's answer that it is mapped.
    #[serde(default)]
    pub share_at_read: LatencySummary,
}

/// The agents' histograms, in the order of [`OpLatencies::from_histograms`].
pub const AGENT_OPS: usize = 7;

impl OpLatencies {
    /// The operations' names, in the order of the fields (the `op` label of the
    /// exposition's latency histogram).
    pub const OPS: [&'static str; 10] = [
        "share",
        "cow_break",
        "fault",
        "reclaim",
        "track",
        "stash",
        "unstash",
        "patch_encode",
        "compress",
        "share_at_read",
    ];

    /// Time the guest's threads waited on the agent's service of their faults, µs: CoW
    /// breaks, missing faults (first touches, refills), the clock's R/M faults and
    /// decodes of stored pages, each from the agent reading the fault to waking the
    /// thread (a lower bound: the time before the agent reads a fault is not in it).
    pub fn guest_wait_us(&self) -> f64 {
        self.cow_break.total_us + self.fault.total_us + self.track.total_us + self.unstash.total_us
    }

    /// Summaries of the agents' [share, CoW break, fault, reclaim, track, stash, unstash]
    /// histograms (memfoldd's own encode times are set apart).
    pub fn from_histograms(h: &[OpLatency; AGENT_OPS]) -> OpLatencies {
        OpLatencies {
            share: h[0].summary(),
            cow_break: h[1].summary(),
            fault: h[2].summary(),
            reclaim: h[3].summary(),
            track: h[4].summary(),
            stash: h[5].summary(),
            unstash: h[6].summary(),
            ..Default::default()
        }
    }
}

/// How long pages stayed patched or compressed before the guest touched them again
/// (DE Figure 4: a good clock picks pages that stay cold).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LifetimeCdf {
    /// Stashed pages the guests touched again.
    pub restored: u64,
    /// Pages stashed now (their lifetime is at least their age).
    pub stashed_now: u64,
    /// (seconds, fraction of the restored pages restored sooner), at 1, 2, 5, 10, 20,
    /// 30, 60, 120, 300 s.
    pub restored_before: Vec<(f64, f64)>,
    /// Fraction of all pages ever stashed that lived at least 10 s, counting pages
    /// still stashed for 10 s or more (DE Fig 4's "~80% live ≥ 10 s").
    pub lived_10s: f64,
}

/// Host pages saved, by mechanism (DE Fig 9–11's breakdown).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SavedBy {
    /// Sharing: guest pages mapped onto pool frames − frames mapped.
    pub sharing: i64,
    /// Zero pages reclaimed (not counting `free`).
    pub zero: i64,
    /// Free pages an enlightened guest reported, discarded without a copy and not touched
    /// since (issue 17, PV §3.1: "free (guest-reported)"; 0 from an older memfoldd).
    #[serde(default)]
    pub free: i64,
    /// Patching: patched pages − their store slots (pages) − frames held only as
    /// reference pages.
    pub patching: i64,
    /// Compression: compressed pages − their store slots (pages).
    pub compression: i64,
    /// Swap (DE §4.6): pages in the swap file (patched, compressed or raw); on disk, they
    /// take no host memory.
    pub swap: i64,
    /// Store pages not covered by live slots (fragmentation; subtracted from the total).
    pub store_waste: i64,
    /// The kernel's swap (issue 15's zswap backing): pages and pool frames paged out −
    /// the zswap pool's share of them, estimated at the host's ratio (`Zswap:` over
    /// `Zswapped:` in /proc/meminfo: the kernel does not say per page); all of them when
    /// zswap holds none (they went to the swap file on disk). 0 from an older memfoldd.
    #[serde(default)]
    pub zswap: i64,
}

/// Pages memfold sent to the kernel's swap (issue 15's zswap backing), all guests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KernelSwapStats {
    /// Pages paged out and not yet seen back.
    pub paged_out_pages: u64,
    /// Pages paged out (cumulative).
    pub page_outs: u64,
    /// Paged-out pages found in RAM again (cumulative).
    pub paged_ins: u64,
    /// Page-outs answered with the page still in RAM, or refused (cumulative).
    pub page_outs_kept: u64,
    /// Pool pages in the kernel's swap now: the frames only patches hold that memfoldd
    /// paged out (one copy for every page that patches against it), and any pool page the
    /// kernel swapped on its own (0 from an older memfoldd).
    #[serde(default)]
    pub frames_paged_out: u64,
    /// Pool frames paged out (cumulative).
    #[serde(default)]
    pub frame_page_outs: u64,
    /// The zswap pool's bytes, host-wide (`Zswap:`), at the time of these statistics.
    pub zswap_pool_bytes: u64,
    /// Bytes of the pages zswap holds, host-wide (`Zswapped:`).
    pub zswapped_bytes: u64,
}

/// The engine's own metadata by structure, bytes (docs/metadata.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetadataBy {
    /// Per guest page: P2M entries, clock bytes and hints, scan ages, categories.
    pub pages: u64,
    /// The pools' frame books.
    pub frames: u64,
    /// The share tables (shared frames, the current scan's hints, hints kept across scans).
    pub share_table: u64,
    /// The similarity indexes.
    pub similarity: u64,
    /// The blob table (one record a stored page).
    pub blobs: u64,
}

/// What the backings hold against what the books say they should: a leak check. The
/// pools (every domain's), the stores and the swap files (every guest's), bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldBytes {
    /// Bytes the pools hold (holes taking none).
    pub pool: u64,
    /// Bytes of the frames the books hold (in use or pinned by an adopted pool).
    pub pool_booked: u64,
    /// Bytes the stores hold.
    pub store: u64,
    /// Bytes of the store chunks holding a live blob.
    pub store_booked: u64,
    /// Bytes the swap files hold.
    pub swap: u64,
    /// Bytes of the swap chunks holding a live blob.
    pub swap_booked: u64,
}

impl HeldBytes {
    /// Bytes held past the books', over the pools, stores and swap files.
    pub fn unbooked(&self) -> i64 {
        (self.pool + self.store + self.swap) as i64
            - (self.pool_booked + self.store_booked + self.swap_booked) as i64
    }
}

/// The host memory budget and the swap file (DE §4.6). Pages are 4 KiB.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwapStats {
    /// The budget, pages; `None`: no budget, no swapping.
    pub budget_pages: Option<u64>,
    /// Host pages the guests' RAM used (memfds, pool, store) at the last check.
    pub host_used_pages: u64,
    /// Guest pages in the swap file now.
    pub swapped_pages: u64,
    /// Bytes of swap slots in use.
    pub slot_bytes: u64,
    /// Swap file pages (disk blocks) in use.
    pub file_pages: u64,
    /// Swap file capacity, pages.
    pub capacity_pages: u64,
    /// Swap-outs refused because the swap file was full (cumulative).
    pub full: u64,
    /// Pages still to swap out to get under the budget.
    pub wanted_pages: u64,
}

/// One guest's counters. Pages are 4 KiB; counters are cumulative since attach.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct VmStats {
    /// Guest name.
    pub name: String,
    /// QEMU's pid.
    pub pid: u32,
    /// Guest RAM, pages.
    pub pages: u64,
    /// Bytes of its agent's record of its pages (page homes, R/M bits) in QEMU, as the
    /// agent last reported (issue 19: metadata per GiB of guest RAM).
    #[serde(default)]
    pub agent_state_bytes: u64,
    /// Mappings (VMAs) of its QEMU as its agent counts them (an upper bound; several
    /// regions of one QEMU report the same process), against `vm.max_map_count`.
    #[serde(default)]
    pub qemu_mappings: u64,
    /// Its agent's VMA budget, mappings: shares stop at seven eighths of it, and the
    /// saving goes on without mappings past it (issue 19). 0: not said.
    #[serde(default)]
    pub qemu_vma_budget: u64,
    /// CoW breaks its agent made of a whole run of shared pages at the VMA budget
    /// (cumulative; issue 19).
    #[serde(default)]
    pub run_breaks: u64,
    /// Pages its agent broke ahead of a sequential writer (cumulative; each also a CoW
    /// break).
    #[serde(default)]
    pub ahead_breaks: u64,
    /// Pages its agent broke without a copy, under a device's declaration that its write
    /// overwrites them whole (cumulative; each also a CoW break; Satori §4.3).
    #[serde(default)]
    pub nocopy_breaks: u64,
    /// Runs of pages its agent's clock scans zapped (private pages armed, pages on
    /// frames), cumulative: each a `MADV_DONTNEED` and a remove event in its QEMU.
    #[serde(default)]
    pub clock_zaps: u64,
    /// Runs its agent's clock scans protected but did not zap, none of their pages being
    /// mapped (cumulative; the clock's `pagemap` mode).
    #[serde(default)]
    pub clock_zaps_skipped: u64,
    /// Host memory this guest holds alone, bytes: its RAM memfd and its store memfd as
    /// allocated (holes take none; its sharing domain's pool is counted apart, in
    /// [`HeldBytes::pool`], as its frames serve every guest of the domain).
    #[serde(default)]
    pub host_bytes: u64,
    /// Guest pages mapped onto pool frames now.
    pub shared_pages: u64,
    /// Of those, pages mapped onto the zero frame.
    pub zero_shared_pages: u64,
    /// Zero pages reclaimed now (holes the agent refills on access).
    pub zero_reclaimed_pages: u64,
    /// Pages hashed by the scanner.
    pub scanned_pages: u64,
    /// Resident pages the scanner left out of a full scan as quiet (cumulative,
    /// page-scans).
    #[serde(default)]
    pub skipped_pages: u64,
    /// Pages shared (cumulative).
    pub shares: u64,
    /// Guest pages a disk read filled, as the block device reported them (Satori §4.1;
    /// cumulative).
    #[serde(default)]
    pub read_landed: u64,
    /// Of [`VmStats::shares`], those asked the moment a disk read filled the page (the
    /// page's and its twin's), not found by the scan (cumulative).
    #[serde(default)]
    pub read_shares: u64,
    /// Of [`VmStats::read_shares`], pages a disk read had filled from a frame holding its
    /// base block, without the disk (Satori §5.2; cumulative).
    #[serde(default)]
    pub read_fills: u64,
    /// Landings not shared at read because the page is a read buffer the guest reuses
    /// (its shares at read were undone by a write within 250 ms; cumulative).
    #[serde(default)]
    pub read_backoffs: u64,
    /// Copy-on-write breaks (cumulative).
    pub cow_breaks: u64,
    /// Zero pages reclaimed (cumulative).
    pub reclaims: u64,
    /// Reclaimed pages the guest touched again, refilled by the agent (cumulative).
    pub refills: u64,
    /// Shared, reclaimed or stored pages QEMU discarded (a balloon, free page reporting),
    /// released without being brought back (cumulative).
    #[serde(default)]
    pub discards: u64,
    /// Free pages of an enlightened guest asked to be watched for a discard (issue 17;
    /// cumulative).
    #[serde(default)]
    pub free_watches: u64,
    /// Free pages discarded without copying: the guest reported them free after they were
    /// watched, and nothing wrote them since (cumulative; while untouched they count in
    /// `zero_reclaimed_pages`).
    #[serde(default)]
    pub free_discards: u64,
    /// Of `free_discards`, pages that were shared: dropped from their frames with no
    /// copy (Satori §4.3's no-copy-on-write, per page; cumulative).
    #[serde(default)]
    pub free_discards_shared: u64,
    /// Of `free_discards`, pages that were stored (patched, compressed or swapped): their
    /// blobs released (cumulative).
    #[serde(default)]
    pub free_discards_stored: u64,
    /// Of `zero_reclaimed_pages`, discarded free pages not touched since: what free-page
    /// discard saves now, pages (issue 17).
    #[serde(default)]
    pub free_reclaimed_pages: u64,
    /// No-copy-on-write (Satori §4.3): of [`VmStats::discards`], the shared pages —
    /// dropped to holes instead of copied at the guest's next write (cumulative).
    #[serde(default)]
    pub cow_copies_avoided: u64,
    /// Its store floor: idle clock scans a page needs before it is patched, compressed
    /// or shared without a mapping, raised while the guest waits on its agent over
    /// memfoldd's `--wait-target` (issue 15; 0 without one).
    #[serde(default)]
    pub store_floor: u8,
    /// Its share of time waiting on its agent in the last 10 s window, percent, as the
    /// wait target measured it (`None`: no target, or no whole window yet).
    #[serde(default)]
    pub wait_share_pct: Option<f64>,
    /// Times its store floor was raised (cumulative).
    #[serde(default)]
    pub store_floor_raised: u64,
    /// Write-protect faults the agent served (CoW breaks and writers that waited on a
    /// share or reclaim in progress; cumulative).
    pub wp_faults: u64,
    /// Missing-page faults the agent served (first touches and refills; cumulative).
    pub missing_faults: u64,
    /// Minor faults the agent served for the clock's R/M tracking (cumulative).
    pub minor_faults: u64,
    /// Private pages per NRU class C1, C2, C3, C4 in the clock's last full pass (DE §4.2).
    pub nru_pages: [u64; 4],
    /// Full clock passes over this guest.
    pub clock_passes: u64,
    /// The agent's operation latencies.
    pub latency: OpLatencies,
    /// Share requests whose page had changed before the agent protected it.
    pub share_changed: u64,
    /// Pages the sharing scan left alone because the clock's last scan found them
    /// recently modified (C1, which DE §4.2's policies ignore; cumulative).
    pub hot_skipped: u64,
    /// Share requests the agent refused (VMA budget, already shared).
    pub share_refused: u64,
    /// Pages shared without a mapping now: identical to a pool frame, punched out of guest
    /// RAM and kept as a reference to the frame, no VMA in QEMU (issue 19). Not in
    /// `shared_pages`.
    #[serde(default)]
    pub unmapped_pages: u64,
    /// Pages shared without a mapping (cumulative).
    #[serde(default)]
    pub unmapped_shares: u64,
    /// Of those, pages mapped onto their frame first and turned into shares without a
    /// mapping under VMA pressure (cumulative; issue 19).
    #[serde(default)]
    pub unmaps: u64,
    /// Pages stored as patches now (DE §3.2).
    pub patched_pages: u64,
    /// Pages stored compressed now (DE §3.3).
    pub compressed_pages: u64,
    /// Pages paged out to the kernel's swap now (issue 15's zswap backing; 0 from an
    /// older memfoldd).
    #[serde(default)]
    pub paged_out_pages: u64,
    /// Pages paged out to the kernel's swap (cumulative).
    #[serde(default)]
    pub page_outs: u64,
    /// Paged-out pages found in RAM again: the kernel's swap-ins (cumulative).
    #[serde(default)]
    pub paged_ins: u64,
    /// Pages patched (cumulative).
    pub patches: u64,
    /// Pages compressed (cumulative).
    pub compressions: u64,
    /// Patched or compressed pages the guest touched again, decoded back (cumulative).
    pub unstashes: u64,
    /// Stash requests whose page had changed before the agent protected it.
    pub stash_changed: u64,
    /// Stash requests the agent refused.
    pub stash_refused: u64,
    /// Pages in the swap file now (DE §4.6).
    pub swapped_pages: u64,
    /// Pages swapped out (cumulative).
    pub swap_outs: u64,
    /// Swapped pages the guest touched again, read back (cumulative).
    pub swap_ins: u64,
    /// Of the swap-outs, patched or compressed pages moved from the store (cumulative).
    pub swap_moves: u64,
    /// The agent's connection is lost but QEMU lives (its mappings are kept).
    pub detached: bool,
    /// The operator opted the guest out: its pages are taken back, none managed.
    #[serde(default)]
    pub opted_out: bool,
    /// CPU seconds (user + system) of the agent's threads in this guest's QEMU, since
    /// they started (0 if `/proc` does not say).
    #[serde(default)]
    pub agent_cpu_s: f64,
    /// Its shared pages by the sharing rank of the frame each maps, `(rank, pages)`,
    /// rank ascending; the zero frame left out (Satori §4.2; memfold_core's
    /// `SharingRanks`).
    #[serde(default)]
    pub sharing_ranks: Vec<(u32, u64)>,
    /// Its sharing entitlement `s(i) = Σ (rank − 1) / rank` over its shared pages, pages
    /// (Satori §4.2): its part of the memory sharing saves.
    #[serde(default)]
    pub entitlement_pages: f64,
    /// What memfoldd asked its balloon to leave the guest (allowance + what it claims),
    /// bytes; `None`: no balloon driven (Satori §4.2). The balloon is its QEMU's: a guest
    /// of several RAM regions shows the same balloon on each, set for their sum.
    #[serde(default)]
    pub balloon_target_bytes: Option<u64>,
    /// What its balloon leaves it now (QMP `query-balloon`), bytes; `None`: not known.
    #[serde(default)]
    pub balloon_actual_bytes: Option<u64>,
    /// Why its balloon is not driven or lags (no monitor, no driver, ignored requests).
    #[serde(default)]
    pub balloon_problem: Option<String>,
    /// Memory available to the guest by its balloon driver's statistics
    /// (`stat-available-memory`), bytes; `None`: not reported.
    #[serde(default)]
    pub guest_available_bytes: Option<u64>,
    /// Whether the guest is short of memory by those statistics (claiming
    /// `under-pressure`); `None`: not known.
    #[serde(default)]
    pub guest_short: Option<bool>,
    /// What its guest agent (`memfold-guest`, issue 17) says its pages are, if it is
    /// enlightened; `None` for a guest that says nothing.
    #[serde(default)]
    pub guest_pages: Option<GuestPages>,
}

/// An enlightened guest's pages by category as its agent last reported them (PV §3.1;
/// `memfold_core::categories`), and how the sharing scan used them. Pages are 4 KiB.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GuestPages {
    /// Free (buddy allocator, per-CPU lists).
    pub free: u64,
    /// Page cache (on an LRU list, not anonymous).
    pub cache: u64,
    /// Anonymous.
    pub anon: u64,
    /// Slab.
    pub slab: u64,
    /// Kernel-only, reserved and other pages in use.
    pub kernel: u64,
    /// Not reported (holes in the guest's frames, no report).
    pub unknown: u64,
    /// On the guest's active LRU list.
    pub active: u64,
    /// Referenced by the guest's kernel's last look.
    pub referenced: u64,
    /// Marked never to be shared by the guest (`memfold-guest never-share`: a process's
    /// or a file's pages; Satori §4.3).
    pub never_share: u64,
    /// Pages memfoldd took back into guest RAM because the guest marked them never to be
    /// shared after they were shared or patched (cumulative).
    pub never_share_takebacks: u64,
    /// Reports applied (cumulative).
    pub reports: u64,
    /// Reports refused: lines out of place, over the limits, or runs not fitting its RAM
    /// (cumulative).
    pub refused: u64,
    /// Requests its channel did not answer in time or with lines of the protocol (the
    /// channel is then reopened; a guest booting, its agent not yet started, counts here),
    /// cumulative.
    pub channel_errors: u64,
    /// Resident pages the sharing scan passed over as of a skipped category (memfoldd's
    /// `--guest-skip`), page-scans
    /// (cumulative).
    pub scan_skipped: u64,
    /// Its agent's name and version, and its kernel's release.
    pub agent: String,
    /// What the guest's `/proc/meminfo` said with the report, KiB.
    pub meminfo: crate::guest::GuestMeminfo,
    /// The guest's RAM below 4 GiB and above, pages (the layout its gfns were mapped by).
    pub low_pages: u64,
    /// See [`GuestPages::low_pages`].
    pub high_pages: u64,
    /// The layout is QEMU's own (asked on memfoldd's monitor of it), not inferred from
    /// the guest's RAM ranges; only then may free pages above 4 GiB be discarded.
    pub layout_exact: bool,
    /// The last error of its channel, if its last request failed.
    pub last_error: Option<String>,
    /// Mean time from memfoldd's request to the report's last line, over the reports
    /// answered, ms: mostly the guest agent's own work (it reads a word of
    /// `/proc/kpageflags` per frame, and of `/proc/kpagecount` where the flags leave the
    /// category open), done on a guest vCPU — the price the
    /// guest pays for each report, at memfoldd's `--guest-interval-ms`.
    pub report_ms: f64,
    /// The longest such time, ms.
    pub report_max_ms: f64,
    /// Mean time the guest agent says it spent reading its kernel's page flags and counts
    /// and classifying them, over the reports that said (`FromGuest::End::walk_us`;
    /// [`GuestPages::report_ms`] is over every report answered), ms: most of a report's
    /// cost; the rest is its other reads (`/proc/iomem`, `/proc/meminfo`, never-share
    /// marks), the encoding and the transfer (0: no report said).
    #[serde(default)]
    pub walk_ms: f64,
}

/// memfoldd's statistics.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Seconds since memfoldd started.
    pub uptime_s: f64,
    /// CPU seconds (user + system) of the process memfoldd runs in, since it started.
    #[serde(default)]
    pub cpu_s: f64,
    /// Scan rate limit, pages/s (0: unlimited).
    pub rate_pages_per_s: u64,
    /// Completed scans over all guests.
    pub full_scans: u64,
    /// Pool frames holding shared content.
    pub frames: u64,
    /// Guest pages mapped onto pool frames (sum of reference counts).
    pub mapped_pages: u64,
    /// Zero pages reclaimed now.
    pub zero_reclaimed_pages: u64,
    /// Host pages saved: mapped pages − frames + reclaimed zero pages + patched and
    /// compressed pages − store pages (ESX §5's "memory saved", DE §5's savings).
    pub saved_pages: i64,
    /// The same, by mechanism.
    pub saved_by: SavedBy,
    /// Pages stored as patches now.
    pub patched_pages: u64,
    /// Pages shared without a mapping now (punched, identical to a pool frame).
    #[serde(default)]
    pub unmapped_pages: u64,
    /// Pages stored compressed now.
    pub compressed_pages: u64,
    /// Pages of the store memfd in use (chunks holding a live blob).
    pub store_pages: u64,
    /// Pool frames held only as patch reference pages (no guest page maps them).
    pub reference_frames: u64,
    /// The host memory budget and the swap file (DE §4.6).
    pub swap: SwapStats,
    /// Patched/compressed page lifetimes.
    pub lifetime: LifetimeCdf,
    /// The Difference Engine policy by name (`sharing`, `de`, ...).
    pub policy: String,
    /// Share-table entries (shared frames and hints).
    pub table_entries: u64,
    /// Whether this memfoldd adopted the pool of a previous one (restart).
    pub adopted_pool: bool,
    /// Sharing domains, each with a pool of its own.
    #[serde(default)]
    pub domains: u64,
    /// What the backings hold against the books (a leak check).
    #[serde(default)]
    pub held: HeldBytes,
    /// Blobs a store or swap file could not take (out of memory, disk full, EIO;
    /// cumulative): each page stayed in guest RAM.
    #[serde(default)]
    pub blob_write_errors: u64,
    /// Operation latencies over all guests.
    pub latency: OpLatencies,
    /// The same operations' histograms in the exported buckets, over all guests, in the
    /// order of [`OpLatencies::OPS`] (empty from a memfoldd older than this field).
    #[serde(default)]
    pub latency_buckets: Vec<OpBuckets>,
    /// Bytes of the engine's own metadata (P2M, clock, frame books, share table,
    /// similarity index, blob table; docs/metadata.md).
    #[serde(default)]
    pub metadata_bytes: u64,
    /// The same by structure (zeros from a memfoldd older than this field).
    #[serde(default)]
    pub metadata_by: MetadataBy,
    /// Base blocks learnt as held by a frame since start, each checked against the base's
    /// own bytes (Satori §5.2; cumulative).
    #[serde(default)]
    pub blocks_indexed: u64,
    /// Base blocks held by frames now, all domains: reads of them can be filled.
    #[serde(default)]
    pub blocks_held: u64,
    /// memfoldd's resident set (`VmRSS`), bytes; 0 if `/proc` does not say.
    #[serde(default)]
    pub rss_bytes: u64,
    /// Pages sent to the kernel's swap (zeros from an older memfoldd).
    #[serde(default)]
    pub kernel_swap: KernelSwapStats,
    /// Per guest: every guest for an operator, only its own for a tenant, in name order.
    /// Empty in the head of statistics sent in parts ([`Stats::vms_following`]).
    pub vms: Vec<VmStats>,
    /// Guests whose [`VmStats`] follow this message in [`crate::ToClient::StatsVms`]
    /// parts ([`crate::stats_parts`]): statistics too large for one message. 0 (and
    /// absent on the wire): every guest is in [`Stats::vms`]; a reader's assembled
    /// statistics always say 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub vms_following: u32,
    /// `Some(uid)`: the view of a tenant (a QEMU user of the agent group, not an
    /// operator), which lists only the guests whose QEMUs run as `uid`; every host-wide
    /// figure above other than `uptime_s`, `rate_pages_per_s` and `policy` is then left
    /// at zero, since it counts other tenants' guests too (their names, sizes and
    /// activity are not a tenant's to see). `None`: an operator's view.
    #[serde(default)]
    pub tenant_uid: Option<u32>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}
