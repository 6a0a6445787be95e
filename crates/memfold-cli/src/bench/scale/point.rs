//! One point of `memfold bench scale`: a guest set's costs, from memfold's run (memfoldd's
//! statistics, sampled each second) and the KSM side's, and the least-squares slope of a
//! cost over the points.

use serde::Serialize;

use crate::compare::KsmSide;
use crate::run::measure::{MemfoldRun, MIB};

const GIB: f64 = 1024.0 * MIB;

/// One point's costs. Pages are 4 KiB; `None`: not measured (no KSM side, no operation
/// of that kind timed, nothing saved).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Point {
    /// Guests in the set.
    pub guests: u32,
    /// RAM per guest, MiB.
    pub mem_mib: u32,
    /// Host memory the guests' RAM used before memfoldd started, MiB.
    pub memfold_used_before_mib: f64,
    /// Host memory memfold saved (mean of the last 10 s), % of that.
    pub memfold_saved_pct: f64,
    /// Seconds to 95% of memfold's plateau.
    pub memfold_t95_s: Option<f64>,
    /// memfoldd + agents' CPU seconds over the run.
    pub memfold_cpu_s: f64,
    /// The same per GiB saved.
    pub memfold_cpu_s_per_gib_saved: Option<f64>,
    /// KSM's saving, % of the host memory its guests used before.
    pub ksm_saved_pct: Option<f64>,
    /// Seconds to 95% of KSM's plateau.
    pub ksm_t95_s: Option<f64>,
    /// ksmd's CPU seconds per GiB saved.
    pub ksm_cpu_s_per_gib_saved: Option<f64>,
    /// Guest pages memfoldd's scan read, GiB, over the run.
    pub scanned_gib: f64,
    /// Those GiB per memfoldd CPU second (what one core of memfoldd reads, everything
    /// else it does included).
    pub scan_gib_per_cpu_s: Option<f64>,
    /// Engine metadata + the agents' page records at the end, % of guest RAM (ESX §4.3:
    /// under 0.5%).
    pub metadata_pct: f64,
    /// The largest of the same over the samples (one a second) whose time since memfoldd
    /// started is at least half the last one's, % of guest RAM: the end's figure depends
    /// on the full scan under way (its hints); this one is at least every reading of the
    /// run's second half.
    pub metadata_late_max_pct: f64,
    /// The engine's metadata at the end, bytes.
    pub engine_metadata_bytes: u64,
    /// That by structure (P2M and per-page bytes, frames, share table, similarity
    /// index, blob table), bytes.
    pub engine_metadata_by: memfold_wire::MetadataBy,
    /// The agents' page records at the end, bytes (all guests).
    pub agent_state_bytes: u64,
    /// Pages stored as patches at the end (DE §3.2), all guests.
    pub patched_pages: u64,
    /// Pages stored compressed at the end (DE §3.3), all guests.
    pub compressed_pages: u64,
    /// memfoldd's largest resident set over the run, bytes.
    pub memfoldd_rss_bytes: u64,
    /// That, % of guest RAM.
    pub memfoldd_rss_pct: f64,
    /// Mappings (VMAs) of the QEMU with the most, largest over the run, as its agent
    /// counts them.
    pub max_qemu_mappings: u64,
    /// Guest RAM per QEMU at which, at this point's mappings per GiB, the QEMU would
    /// reach `vm.max_map_count` (the VMA wall), GiB.
    pub vma_wall_gib: Option<f64>,
    /// Share latency per page, p50 / p99, µs (all agents, end of run).
    pub share_p50_us: Option<f64>,
    /// See `share_p50_us`.
    pub share_p99_us: Option<f64>,
    /// CoW break, p50 / p99, µs.
    pub cow_break_p50_us: Option<f64>,
    /// See `cow_break_p50_us`.
    pub cow_break_p99_us: Option<f64>,
    /// Decode of a stored page on access (missing fault), p50 / p99, µs.
    pub unstash_p50_us: Option<f64>,
    /// See `unstash_p50_us`.
    pub unstash_p99_us: Option<f64>,
}

/// A cost of a point, by name, for the CSV, the slopes and the plots.
pub type Cost = (&'static str, fn(&Point) -> Option<f64>);

impl Point {
    /// The costs whose growth `scale.csv` lists and whose slopes `scale.json` gives.
    pub const COSTS: [Cost; 18] = [
        ("memfold_used_before_mib", |p| {
            Some(p.memfold_used_before_mib)
        }),
        ("memfold_saved_pct", |p| Some(p.memfold_saved_pct)),
        ("ksm_saved_pct", |p| p.ksm_saved_pct),
        ("memfold_t95_s", |p| p.memfold_t95_s),
        ("ksm_t95_s", |p| p.ksm_t95_s),
        ("memfold_cpu_s_per_gib_saved", |p| {
            p.memfold_cpu_s_per_gib_saved
        }),
        ("ksm_cpu_s_per_gib_saved", |p| p.ksm_cpu_s_per_gib_saved),
        ("scan_gib_per_cpu_s", |p| p.scan_gib_per_cpu_s),
        ("metadata_pct", |p| Some(p.metadata_pct)),
        ("metadata_late_max_pct", |p| Some(p.metadata_late_max_pct)),
        ("memfoldd_rss_mib", |p| {
            Some(p.memfoldd_rss_bytes as f64 / MIB)
        }),
        ("max_qemu_mappings", |p| Some(p.max_qemu_mappings as f64)),
        ("share_p50_us", |p| p.share_p50_us),
        ("share_p99_us", |p| p.share_p99_us),
        ("cow_break_p50_us", |p| p.cow_break_p50_us),
        ("cow_break_p99_us", |p| p.cow_break_p99_us),
        ("unstash_p50_us", |p| p.unstash_p50_us),
        ("unstash_p99_us", |p| p.unstash_p99_us),
    ];

    /// The point of `guests` guests of `mem_mib` MiB, from memfold's run and the KSM
    /// side's (if run); `max_map_count` is the host's `vm.max_map_count` (`None`: not
    /// known, no VMA wall given).
    pub fn new(
        guests: u32,
        mem_mib: u32,
        m: &MemfoldRun,
        ksm: Option<&KsmSide>,
        max_map_count: Option<f64>,
    ) -> Point {
        let ram = guests as f64 * mem_mib as f64 * MIB;
        let pct = |saved: f64, before: u64| saved / (before as f64).max(1.0) * 100.0;
        let per_gib = |cpu: f64, saved: f64| (saved > 0.0).then(|| cpu / (saved / GIB));
        let end = m.samples.last();
        let scanned_pages: u64 =
            end.map_or(0, |s| s.stats.vms.iter().map(|v| v.scanned_pages).sum());
        let daemon_cpu = end.map_or(0.0, |s| s.stats.cpu_s);
        let engine_metadata_bytes = end.map_or(0, |s| s.stats.metadata_bytes);
        let agents = |s: &crate::run::measure::Sample| -> u64 {
            s.stats.vms.iter().map(|v| v.agent_state_bytes).sum()
        };
        let agent_state_bytes = end.map_or(0, agents);
        let metadata = |s: &crate::run::measure::Sample| s.stats.metadata_bytes + agents(s);
        let half = end.map_or(0.0, |s| s.t / 2.0);
        let metadata_late_max = m
            .samples
            .iter()
            .filter(|s| s.t >= half)
            .map(metadata)
            .max()
            .unwrap_or(0);
        let memfoldd_rss_bytes = m
            .samples
            .iter()
            .map(|s| s.stats.rss_bytes)
            .max()
            .unwrap_or(0);
        // The largest count any agent reported (the agents of one QEMU's regions each
        // report the whole process's).
        let max_qemu_mappings = m
            .samples
            .iter()
            .flat_map(|s| s.stats.vms.iter().map(|v| v.qemu_mappings))
            .max()
            .unwrap_or(0);
        let mappings_per_gib = max_qemu_mappings as f64 / (mem_mib as f64 / 1024.0);
        let lat = end.map(|s| s.stats.latency);
        let timed = |f: fn(&memfold_wire::OpLatencies) -> memfold_wire::LatencySummary,
                     p99: bool| {
            lat.map(|l| f(&l))
                .filter(|s| s.count > 0)
                .map(|s| if p99 { s.p99_us } else { s.p50_us })
        };
        let scanned_gib = scanned_pages as f64 * 4096.0 / GIB;
        Point {
            guests,
            mem_mib,
            memfold_used_before_mib: m.used_before as f64 / MIB,
            memfold_saved_pct: pct(m.saved_bytes, m.used_before),
            memfold_t95_s: m.t95_s,
            memfold_cpu_s: m.cpu_s,
            memfold_cpu_s_per_gib_saved: per_gib(m.cpu_s, m.saved_bytes),
            ksm_saved_pct: ksm.map(|k| pct(k.run.saved_bytes, k.run.used_before)),
            ksm_t95_s: ksm.and_then(|k| k.run.t95_s),
            ksm_cpu_s_per_gib_saved: ksm.and_then(|k| per_gib(k.cpu_s, k.run.saved_bytes)),
            scanned_gib,
            scan_gib_per_cpu_s: (daemon_cpu > 0.0).then(|| scanned_gib / daemon_cpu),
            metadata_pct: (engine_metadata_bytes + agent_state_bytes) as f64 / ram * 100.0,
            metadata_late_max_pct: metadata_late_max as f64 / ram * 100.0,
            engine_metadata_bytes,
            engine_metadata_by: end.map_or(Default::default(), |s| s.stats.metadata_by),
            agent_state_bytes,
            patched_pages: end.map_or(0, |s| s.stats.patched_pages),
            compressed_pages: end.map_or(0, |s| s.stats.compressed_pages),
            memfoldd_rss_bytes,
            memfoldd_rss_pct: memfoldd_rss_bytes as f64 / ram * 100.0,
            max_qemu_mappings,
            vma_wall_gib: max_map_count
                .filter(|_| mappings_per_gib > 0.0)
                .map(|c| c / mappings_per_gib),
            share_p50_us: timed(|l| l.share, false),
            share_p99_us: timed(|l| l.share, true),
            cow_break_p50_us: timed(|l| l.cow_break, false),
            cow_break_p99_us: timed(|l| l.cow_break, true),
            unstash_p50_us: timed(|l| l.unstash, false),
            unstash_p99_us: timed(|l| l.unstash, true),
        }
    }

    /// One line saying the point, for stderr as the sweep goes.
    pub fn line(&self) -> String {
        format!(
            "  {} × {} MiB: memfold saved {:.1}% of {:.1} MiB ({:.2} CPU s/GiB saved){}; metadata {:.3}% of guest RAM (at most {:.3}% in the second half), memfoldd RSS {:.1} MiB, most mappings in a QEMU {}",
            self.guests,
            self.mem_mib,
            self.memfold_saved_pct,
            self.memfold_used_before_mib,
            self.memfold_cpu_s_per_gib_saved.unwrap_or(f64::NAN),
            self.ksm_saved_pct
                .map_or(String::new(), |k| format!("; KSM saved {k:.1}%")),
            self.metadata_pct,
            self.metadata_late_max_pct,
            self.memfoldd_rss_bytes as f64 / MIB,
            self.max_qemu_mappings
        )
    }
}

/// Least-squares slope of `y` over `x` for `(x, y)` points: the cost's growth per unit of
/// the varied axis (per guest, or per GiB of guest). `None` for fewer than two distinct
/// `x`.
pub fn slope(pts: &[(f64, f64)]) -> Option<f64> {
    let n = pts.len() as f64;
    if n < 2.0 {
        return None;
    }
    let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
    let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    (sxx > 0.0).then(|| pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum::<f64>() / sxx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::measure::Sample;
    use memfold_wire::{LatencySummary, Stats, VmStats};

    #[test]
    fn a_slope_is_the_least_squares_growth_and_needs_two_distinct_x() {
        assert_eq!(slope(&[(1.0, 3.0), (2.0, 5.0), (4.0, 9.0)]), Some(2.0));
        let s = slope(&[(1.0, 1.0), (2.0, 3.0), (3.0, 2.0)]).unwrap();
        assert!((s - 0.5).abs() < 1e-12, "{s}");
        assert_eq!(slope(&[(1.0, 1.0)]), None);
        assert_eq!(slope(&[(2.0, 1.0), (2.0, 5.0)]), None);
    }

    fn vm(name: &str, pid: u32, scanned: u64, state: u64, maps: u64) -> VmStats {
        VmStats {
            name: name.into(),
            pid,
            scanned_pages: scanned,
            agent_state_bytes: state,
            qemu_mappings: maps,
            ..VmStats::default()
        }
    }

    #[test]
    fn a_point_takes_totals_at_the_end_and_peaks_over_the_run() {
        let sample = |t: f64, rss: u64, maps: u64, meta_mib: u64| Sample {
            t,
            used_bytes: 0,
            own_bytes: 0,
            blk_bytes: 0,
            stats: Stats {
                cpu_s: 2.0,
                metadata_bytes: meta_mib << 20,
                rss_bytes: rss,
                vms: vec![
                    vm("tiny-1", 10, 262_144, 3 << 20, maps),
                    vm("tiny-2", 11, 262_144, 3 << 20, 100),
                ],
                latency: memfold_wire::OpLatencies {
                    share: LatencySummary {
                        count: 5,
                        p50_us: 7.0,
                        p99_us: 70.0,
                        ..LatencySummary::default()
                    },
                    ..Default::default()
                },
                ..Stats::default()
            },
            daemon_restarts: 0,
            paused: vec![],
            census: None,
        };
        let m = MemfoldRun {
            used_before: 512 << 20,
            saved_bytes: (256u64 << 20) as f64,
            cpu_s: 4.0,
            memory_stall_pct: None,
            samples: vec![
                sample(1.0, 50 << 20, 900, 3),
                sample(4.0, 45 << 20, 300, 2),
                sample(5.0, 40 << 20, 300, 1),
            ],
            ..MemfoldRun::default()
        };
        let p = Point::new(2, 512, &m, None, Some(65_530.0));
        assert_eq!(p.memfold_saved_pct, 50.0);
        assert_eq!(
            p.memfold_cpu_s_per_gib_saved,
            Some(16.0),
            "4 CPU s for 0.25 GiB"
        );
        assert_eq!(p.scanned_gib, 2.0, "2 × 1 GiB read by the end");
        assert_eq!(
            p.scan_gib_per_cpu_s,
            Some(1.0),
            "2 GiB in memfoldd's 2 CPU s"
        );
        assert_eq!(p.memfoldd_rss_bytes, 50 << 20, "the peak, not the last");
        assert_eq!(
            p.max_qemu_mappings, 900,
            "the peak over the run and the QEMUs"
        );
        // 1 MiB of books + 6 MiB of agents' records over 1 GiB of guest RAM.
        assert!(
            (p.metadata_pct - 7.0 / 1024.0 * 100.0).abs() < 1e-9,
            "{}",
            p.metadata_pct
        );
        // The second half (t ≥ 2.5 s): 2 MiB of books at 4 s, not the 3 MiB at 1 s.
        assert!(
            (p.metadata_late_max_pct - 8.0 / 1024.0 * 100.0).abs() < 1e-9,
            "{}",
            p.metadata_late_max_pct
        );
        assert_eq!((p.share_p50_us, p.share_p99_us), (Some(7.0), Some(70.0)));
        assert_eq!(p.cow_break_p99_us, None, "nothing timed");
        assert_eq!(p.ksm_saved_pct, None, "no KSM side");
        // 900 mappings in a QEMU of 512 MiB: 1 800 per GiB of guest RAM.
        assert_eq!(p.vma_wall_gib, Some(65_530.0 / 1_800.0));
    }
}
