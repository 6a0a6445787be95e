//! The live view: one block on stderr per second of a run, the total and a line per guest.

use memfold_wire::{SwapStats, VmStats};

use super::measure::{pages_mib, saved_mib, Sample, MIB};

/// Prints sample `s` (rates per second since `prev`), its saving measured against
/// `used_before`.
pub fn print(used_before: u64, s: &Sample, prev: Option<&Sample>) {
    let dt = prev.map_or(1.0, |p| (s.t - p.t).max(0.001));
    let by = &s.stats.saved_by;
    eprintln!(
        "t={:>5.0}s  host {:>7.1} MiB  saved {:>7.1} MiB (books {:>7.1}: share {:.1}, zero {:.1}{}, patch {:.1}, compress {:.1}{}, swap {:.1})  frames {:>7}  scans {}{}",
        s.t,
        s.used_bytes as f64 / MIB,
        saved_mib(used_before, s.used_bytes),
        pages_mib(s.stats.saved_pages),
        pages_mib(by.sharing),
        pages_mib(by.zero),
        if by.free == 0 {
            String::new()
        } else {
            format!(", free {:.1}", pages_mib(by.free))
        },
        pages_mib(by.patching),
        pages_mib(by.compression),
        match &s.stats.kernel_swap {
            k if k.page_outs + k.frame_page_outs == 0 => String::new(),
            k if k.frames_paged_out == 0 => format!(", zswap {:.1}", pages_mib(by.zswap)),
            k => format!(
                ", zswap {:.1} ({} frames)",
                pages_mib(by.zswap),
                k.frames_paged_out
            ),
        },
        pages_mib(by.swap),
        s.stats.frames,
        s.stats.full_scans,
        budget(&s.stats.swap)
    );
    for v in &s.stats.vms {
        let before = prev.and_then(|p| p.stats.vms.iter().find(|w| w.name == v.name));
        let rate =
            |f: fn(&VmStats) -> u64| before.map_or(0.0, |b| f(v).saturating_sub(f(b)) as f64 / dt);
        let nru = if v.clock_passes > 0 {
            let n = v.nru_pages;
            format!("  C1-C4 {} {} {} {}", n[0], n[1], n[2], n[3])
        } else {
            String::new()
        };
        let de = if v.patches + v.compressions + v.swap_outs > 0 {
            format!(
                "  patched {} compressed {} swapped {} decoded back {:.0}/s",
                v.patched_pages,
                v.compressed_pages,
                v.swapped_pages,
                rate(|v| v.unstashes)
            )
        } else {
            String::new()
        };
        // Pages shared without a mapping (no VMA), beside the mapped ones.
        let unmapped = if v.unmapped_shares > 0 {
            format!(" + {} unmapped", v.unmapped_pages)
        } else {
            String::new()
        };
        // Shares made the moment a disk read filled the page (Satori §4.1), not by the scan.
        let at_read = if v.read_landed > 0 {
            format!(
                " ({} of {} shares at read, {} filled from frames)",
                v.read_shares, v.shares, v.read_fills
            )
        } else {
            String::new()
        };
        let enlightened = v.guest_pages.as_ref().map_or(String::new(), guest_pages);
        let balloon = match (v.balloon_actual_bytes, &v.balloon_problem) {
            (_, Some(p)) => format!("  balloon: {p}"),
            (Some(a), None) => format!("  sees {:.0} MiB", a as f64 / MIB),
            (None, None) => String::new(),
        };
        eprintln!(
            "    {:<14} {:>7} pages  shared {:>7}{unmapped}{at_read} (entitled {:>6.1} MiB{balloon})  zero {:>7}{de}  CoW breaks {:>6.0}/s  faults {:>7.0}/s  scanned {:>8.0}/s{nru}{enlightened}{}",
            v.name,
            v.pages,
            v.shared_pages,
            v.entitlement_pages * 4096.0 / MIB,
            v.zero_shared_pages + v.zero_reclaimed_pages,
            rate(|v| v.cow_breaks),
            rate(|v| {
                v.wp_faults
                    .saturating_add(v.missing_faults)
                    .saturating_add(v.minor_faults)
            }),
            rate(|v| v.scanned_pages),
            if s.paused.contains(&v.name) {
                PAUSED
            } else {
                ""
            }
        );
    }
    // Paused guests memfoldd does not list (not attached) are shown too.
    for name in s
        .paused
        .iter()
        .filter(|n| s.stats.vms.iter().all(|v| &v.name != *n))
    {
        eprintln!("    {name:<14}{PAUSED}");
    }
}

/// An enlightened guest's pages by category as its agent last reported them (issue 17),
/// for the view and the summary.
pub fn guest_pages(g: &memfold_wire::GuestPages) -> String {
    let mib = |p: u64| p as f64 * 4096.0 / MIB;
    let err = g
        .last_error
        .as_ref()
        .map_or(String::new(), |e| format!(" (last: {e})"));
    let never = if g.never_share + g.never_share_takebacks > 0 {
        format!(
            ", never-share {:.1} ({} taken back)",
            mib(g.never_share),
            g.never_share_takebacks
        )
    } else {
        String::new()
    };
    // An older memfold-guest does not say how long its walk took.
    let walk = if g.walk_ms > 0.0 {
        format!(", its walk {:.0} ms", g.walk_ms)
    } else {
        String::new()
    };
    format!(
        "  guest says (MiB): free {:.0} cache {:.0} anon {:.0} slab {:.0} kernel {:.0}, active {:.0}{never}; {} reports ({:.0} ms each{walk}, at most {:.0}), {} scan skips{err}",
        mib(g.free),
        mib(g.cache),
        mib(g.anon),
        mib(g.slab),
        mib(g.kernel),
        mib(g.active),
        g.reports,
        g.report_ms,
        g.report_max_ms,
        g.scan_skipped
    )
}

/// How the view marks a guest whose QEMU its agent stopped.
const PAUSED: &str = "  paused (fail closed)";

/// The budget part of the view: host use against the budget, the swap file (empty without
/// a budget).
pub fn budget(w: &SwapStats) -> String {
    let Some(b) = w.budget_pages else {
        return String::new();
    };
    let mib = |p: u64| pages_mib(p as i64);
    format!(
        "  budget {:.0} MiB: using {:.1}, swap file {:.1} of {:.0} MiB{}",
        mib(b),
        mib(w.host_used_pages),
        mib(w.file_pages),
        mib(w.capacity_pages),
        if w.full > 0 { " (full)" } else { "" }
    )
}
