//! memfoldd's statistics: every counter, per guest and in total, as JSON over the socket
//! and in the Prometheus text format.

use serde::{Deserialize, Serialize};

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
    /// Pages hashed by the scanner.
    pub scanned_pages: u64,
    /// Pages shared (cumulative).
    pub shares: u64,
    /// Copy-on-write breaks (cumulative).
    pub cow_breaks: u64,
    /// Share requests whose page had changed before the agent protected it.
    pub share_changed: u64,
    /// Share requests the agent refused (VMA budget, already shared).
    pub share_refused: u64,
    /// The agent's connection is lost but QEMU lives (its mappings are kept).
    pub detached: bool,
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
    /// Host pages saved by sharing: mapped pages − frames (ESX §5's "memory saved").
    pub saved_pages: i64,
    /// Share-table entries (shared frames and hints).
    pub table_entries: u64,
    /// Whether this memfoldd adopted the pool of a previous one (restart).
    pub adopted_pool: bool,
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
            "table_entries",
            "Share-table entries.",
            self.table_entries as f64,
        );
        type Field = fn(&VmStats) -> u64;
        let per_vm: [(&str, &str, Field); 7] = [
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
            ("vm_shares_total", "Pages shared.", |v| v.shares),
            ("vm_cow_breaks_total", "Copy-on-write breaks.", |v| {
                v.cow_breaks
            }),
            (
                "vm_share_changed_total",
                "Share requests whose page had changed.",
                |v| v.share_changed,
            ),
        ];
        for (name, help, f) in per_vm {
            out.push_str(&format!(
                "# HELP memfold_{name} {help}\n# TYPE memfold_{name} gauge\n"
            ));
            for v in &self.vms {
                out.push_str(&format!("memfold_{name}{{vm=\"{}\"}} {}\n", v.name, f(v)));
            }
        }
        out
    }
}
