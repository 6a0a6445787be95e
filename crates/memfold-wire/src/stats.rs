//! memfoldd's statistics: every counter, per guest and in total, as a client gets them
//! ([`crate::ToClient::Stats`]) and in the Prometheus text format.

use serde::{Deserialize, Serialize};

use crate::latency::{LatencySummary, OpLatency};

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
}

/// The agents' histograms, in the order of [`OpLatencies::from_histograms`].
pub const AGENT_OPS: usize = 7;

impl OpLatencies {
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
    /// Zero pages reclaimed.
    pub zero: i64,
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
    /// Pages stored as patches now (DE §3.2).
    pub patched_pages: u64,
    /// Pages stored compressed now (DE §3.3).
    pub compressed_pages: u64,
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
}

/// memfoldd's statistics.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Seconds since memfoldd started.
    pub uptime_s: f64,
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
    /// Per guest.
    pub vms: Vec<VmStats>,
}

impl Stats {
    /// Prometheus text exposition of every counter (`memfold_*`, label `vm`).
    pub fn prometheus(&self) -> String {
        let mut out = String::new();
        let mut g = |name: &str, help: &str, v: f64| {
            out.push_str(&format!(
                "# HELP memfold_{name} {help}\n# TYPE memfold_{name} gauge\nmemfold_{name} {v}\n"
            ));
        };
        g(
            "uptime_seconds",
            "Seconds since memfoldd started.",
            self.uptime_s,
        );
        g(
            "full_scans_total",
            "Completed scans over all guests.",
            self.full_scans as f64,
        );
        g(
            "pool_frames",
            "Pool frames holding shared content.",
            self.frames as f64,
        );
        g(
            "mapped_pages",
            "Guest pages mapped onto pool frames.",
            self.mapped_pages as f64,
        );
        g(
            "saved_pages",
            "Host pages saved by sharing.",
            self.saved_pages as f64,
        );
        g(
            "store_pages",
            "Pages of the store memfd in use.",
            self.store_pages as f64,
        );
        g(
            "reference_frames",
            "Pool frames held only as patch references.",
            self.reference_frames as f64,
        );
        g(
            "host_used_pages",
            "Host pages the guests' RAM used at the last budget check.",
            self.swap.host_used_pages as f64,
        );
        g(
            "swapped_pages",
            "Guest pages in the swap file.",
            self.swap.swapped_pages as f64,
        );
        g(
            "swap_file_pages",
            "Swap file pages in use.",
            self.swap.file_pages as f64,
        );
        g(
            "swap_full_total",
            "Swap-outs refused because the swap file was full.",
            self.swap.full as f64,
        );
        g(
            "table_entries",
            "Share-table entries.",
            self.table_entries as f64,
        );
        type Field = fn(&VmStats) -> u64;
        let per_vm: [(&str, &str, Field); 26] = [
            ("vm_swapped_pages", "Pages in the swap file.", |v| {
                v.swapped_pages
            }),
            ("vm_swap_outs_total", "Pages swapped out.", |v| v.swap_outs),
            ("vm_swap_ins_total", "Swapped pages read back.", |v| {
                v.swap_ins
            }),
            ("vm_patched_pages", "Pages stored as patches.", |v| {
                v.patched_pages
            }),
            ("vm_compressed_pages", "Pages stored compressed.", |v| {
                v.compressed_pages
            }),
            (
                "vm_unstashes_total",
                "Patched or compressed pages decoded back.",
                |v| v.unstashes,
            ),
            ("vm_pages", "Guest RAM, pages.", |v| v.pages),
            (
                "vm_shared_pages",
                "Guest pages mapped onto pool frames.",
                |v| v.shared_pages,
            ),
            (
                "vm_zero_shared_pages",
                "Guest pages mapped onto the zero frame.",
                |v| v.zero_shared_pages,
            ),
            ("vm_scanned_pages_total", "Pages hashed.", |v| {
                v.scanned_pages
            }),
            (
                "vm_skipped_pages_total",
                "Resident pages left out of a full scan as quiet.",
                |v| v.skipped_pages,
            ),
            ("vm_shares_total", "Pages shared.", |v| v.shares),
            ("vm_cow_breaks_total", "Copy-on-write breaks.", |v| {
                v.cow_breaks
            }),
            (
                "vm_share_changed_total",
                "Share requests whose page had changed.",
                |v| v.share_changed,
            ),
            (
                "vm_zero_reclaimed_pages",
                "Zero pages reclaimed now.",
                |v| v.zero_reclaimed_pages,
            ),
            ("vm_reclaims_total", "Zero pages reclaimed.", |v| v.reclaims),
            ("vm_refills_total", "Reclaimed pages refilled.", |v| {
                v.refills
            }),
            (
                "vm_discards_total",
                "Shared, reclaimed or stored pages QEMU discarded (balloon, free page reporting).",
                |v| v.discards,
            ),
            ("vm_wp_faults_total", "Write-protect faults served.", |v| {
                v.wp_faults
            }),
            (
                "vm_missing_faults_total",
                "Missing-page faults served.",
                |v| v.missing_faults,
            ),
            (
                "vm_hot_skipped_total",
                "Pages the sharing scan left alone as C1 (recently modified).",
                |v| v.hot_skipped,
            ),
            (
                "vm_minor_faults_total",
                "Minor faults served (clock tracking).",
                |v| v.minor_faults,
            ),
            ("vm_nru_c1_pages", "Private pages in C1 (last pass).", |v| {
                v.nru_pages[0]
            }),
            ("vm_nru_c2_pages", "Private pages in C2 (last pass).", |v| {
                v.nru_pages[1]
            }),
            ("vm_nru_c3_pages", "Private pages in C3 (last pass).", |v| {
                v.nru_pages[2]
            }),
            ("vm_nru_c4_pages", "Private pages in C4 (last pass).", |v| {
                v.nru_pages[3]
            }),
        ];
        for (name, help, f) in per_vm {
            out.push_str(&format!(
                "# HELP memfold_{name} {help}\n# TYPE memfold_{name} gauge\n"
            ));
            for v in &self.vms {
                out.push_str(&format!("memfold_{name}{{vm=\"{}\"}} {}\n", v.name, f(v)));
            }
        }
        let ops = [
            ("share", self.latency.share),
            ("cow_break", self.latency.cow_break),
            ("fault", self.latency.fault),
            ("reclaim", self.latency.reclaim),
            ("track", self.latency.track),
            ("stash", self.latency.stash),
            ("unstash", self.latency.unstash),
            ("patch_encode", self.latency.patch_encode),
            ("compress", self.latency.compress),
        ];
        out.push_str("# HELP memfold_op_latency_us Live operation latency, µs.\n# TYPE memfold_op_latency_us summary\n");
        for (op, l) in ops {
            out.push_str(&format!(
                "memfold_op_latency_us{{op=\"{op}\",quantile=\"0.5\"}} {}\nmemfold_op_latency_us{{op=\"{op}\",quantile=\"0.99\"}} {}\nmemfold_op_latency_us_count{{op=\"{op}\"}} {}\nmemfold_op_latency_us_sum{{op=\"{op}\"}} {}\n",
                l.p50_us, l.p99_us, l.count, l.total_us
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_text_has_every_gauge_per_guest_and_the_latency_summaries() {
        let s = Stats {
            saved_pages: 12,
            vms: vec![
                VmStats {
                    name: "web".into(),
                    cow_breaks: 3,
                    nru_pages: [1, 2, 3, 4],
                    ..Default::default()
                },
                VmStats {
                    name: "db".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let text = s.prometheus();
        assert!(text.contains("# TYPE memfold_saved_pages gauge\nmemfold_saved_pages 12\n"));
        assert!(text.contains("memfold_vm_cow_breaks_total{vm=\"web\"} 3\n"));
        assert!(text.contains("memfold_vm_cow_breaks_total{vm=\"db\"} 0\n"));
        assert!(text.contains("memfold_vm_nru_c4_pages{vm=\"web\"} 4\n"));
        assert!(text.contains("memfold_op_latency_us_count{op=\"compress\"} 0\n"));
        assert_eq!(text.matches("# HELP ").count(), 12 + 26 + 1);
    }
}
