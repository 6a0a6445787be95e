//! What a run measures: one sample a second of memfoldd's statistics and of the host
//! memory used by guest RAM (`memfold_vm::hostmem`), the plateau and its time to 95%,
//! CPU seconds, the guests' event counts, and with plain twins each workload's throughput
//! managed vs plain.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use memfold_vm::hostmem::{guest_ram_usage, guest_ram_usage_lean, total_used, RamUsage};
use memfold_vm::launcher::{Guest, RamBackend};
use memfold_wire::{Stats, VmStats};
use serde::Serialize;

mod cpu;
mod rates;
pub use cpu::ProcCpu;
pub use rates::{
    around_break, late_rates, ratio_rate, start_marks, throughput, unmeasured, AroundBreak,
    GuestRate, Throughput, BREAK_SETTLE_S, BREAK_WINDOW_S,
};

/// Bytes in a MiB.
pub const MIB: f64 = 1048576.0;

/// `pages` 4 KiB pages in MiB.
pub fn pages_mib(pages: i64) -> f64 {
    pages as f64 * 4096.0 / MIB
}

/// The saving from `before` to `now` (host memory used, bytes), MiB.
pub fn saved_mib(before: u64, now: u64) -> f64 {
    (before as f64 - now as f64) / MIB
}

/// What the measured saving is a difference of, for guest RAM of kind `ram`
/// (`memfold_vm::hostmem`): the label of the measured line in the plots.
pub fn measured_as(ram: RamBackend) -> &'static str {
    match ram {
        RamBackend::Memfd => "allocated memfd bytes",
        RamBackend::Anonymous | RamBackend::AnonymousNoThp => "Pss",
    }
}

/// The saving over a run sampled as (seconds, host memory used): (seconds, MiB saved since
/// `used_before`), the measured line of the memfold and KSM plots.
pub fn saved_mib_over_time(
    used_before: u64,
    samples: impl Iterator<Item = (f64, u64)>,
) -> Vec<(f64, f64)> {
    samples
        .map(|(t, used)| (t, saved_mib(used_before, used)))
        .collect()
}

/// A time to 95% of the plateau, s, as the summaries print it (`-`: never reached).
pub fn t95_text(t95_s: Option<f64>) -> String {
    t95_s.map_or("-".into(), |t| format!("{t:.0}"))
}

/// Host memory used by the guests' RAM now (`memfold_vm::hostmem`, summed over `guests`,
/// each shared memfd counted once): (used, rss), bytes. memfold and KSM runs are sampled
/// by this one function. Guest RAM in the kernel's swap (issue 15's zswap backing, or
/// reclaim of anonymous RAM) counts as its share of the zswap pool ([`zswap_share`]), as
/// the peer's does (`peer.rs`).
///
/// Reads each QEMU's mappings the lean way ([`guest_ram_usage_lean`]: no smaps walk where
/// guest RAM is all memfds), so the rss returned counts anonymous guest RAM only (KSM
/// runs, where it is the whole of guest RAM).
pub fn used(guests: &[Guest]) -> Result<(u64, u64)> {
    let usages = read_each(guests, guest_ram_usage_lean)?;
    let swapped = memfold_vm::hostmem::total_swapped(&usages)
        + usages.iter().map(|u| u.anon_swap_pss).sum::<u64>();
    let pool = if swapped > 0 {
        memfold_sys::reclaim::zswap_pool()
            .map_or(0, |(pool, zswapped)| zswap_share(pool, zswapped, swapped))
    } else {
        0
    };
    Ok((
        total_used(&usages) + pool,
        usages.iter().map(|u| u.rss).sum(),
    ))
}

/// Guest RAM's share of the zswap pool, bytes: `pool` (`Zswap:` in /proc/meminfo) ×
/// `swapped` (guest RAM's bytes in swap) / `zswapped` (`Zswapped:`), at most `pool`.
/// The pool holds every swapped page on the host (QEMU's own cold heap too), so the whole
/// of it would overstate what guest RAM uses; pages zswap wrote on to the swap device
/// are in `swapped` but not in `zswapped`, hence the cap.
pub fn zswap_share(pool: u64, zswapped: u64, swapped: u64) -> u64 {
    if zswapped == 0 {
        return 0;
    }
    (pool as u128 * swapped as u128 / zswapped as u128).min(pool as u128) as u64
}

/// Each guest's RAM mappings as the kernel reports them now (`memfold_vm::hostmem`).
///
/// Errors: a guest's QEMU is gone.
pub fn ram_usages(guests: &[Guest]) -> Result<Vec<RamUsage>> {
    read_each(guests, guest_ram_usage)
}

/// `read` (a `memfold_vm::hostmem` reader: QEMU's pid, the smallest anonymous mapping
/// taken for guest RAM, bytes) of each guest, its RAM's anonymous mapping at least half
/// its size.
fn read_each(
    guests: &[Guest],
    read: fn(u32, u64) -> std::io::Result<RamUsage>,
) -> Result<Vec<RamUsage>> {
    guests
        .iter()
        .map(|g| {
            read(g.pid, g.mem_bytes / 2).with_context(|| format!("guest {}: QEMU gone?", g.name))
        })
        .collect()
}

/// Calls `sample` (with the time the sampling started) once a second, after the second,
/// until `secs` seconds have passed (`None`: no limit) or any of `stops` is set (Ctrl-C,
/// a guest's death, a self-check mismatch): the clock of every memfold, KSM and kit run,
/// whose end figures are means over the last [`PLATEAU_S`] seconds of samples.
pub fn every_second(
    secs: Option<u64>,
    stops: &[&AtomicBool],
    mut sample: impl FnMut(Instant) -> Result<()>,
) -> Result<()> {
    let start = Instant::now();
    while !stops.iter().any(|s| s.load(Ordering::SeqCst))
        && secs.is_none_or(|s| start.elapsed() < Duration::from_secs(s))
    {
        std::thread::sleep(Duration::from_secs(1));
        sample(start)?;
    }
    Ok(())
}

/// Seconds at a run's end its end figures are averaged over.
const PLATEAU_S: f64 = 10.0;

/// The mean of `f` over the samples of the last [`PLATEAU_S`] seconds (by `t`, each
/// sample's time, s; the last sample at least; 0 for none): how every run's end figure
/// (measured saving, KSM's pages_sharing, memfoldd's books) is taken. By time, not a
/// count of samples: on a loaded host a sample can take seconds, and ten of them would
/// reach back to where a still-rising saving was lower (16 guests on 2 cores: 50 s).
pub fn tail_mean<T>(samples: &[T], t: impl Fn(&T) -> f64, f: impl Fn(&T) -> f64) -> f64 {
    let Some(last) = samples.last() else {
        return 0.0;
    };
    let from = t(last) - PLATEAU_S;
    let tail: Vec<&T> = samples.iter().filter(|s| t(s) > from).collect();
    tail.iter().map(|s| f(s)).sum::<f64>() / tail.len() as f64
}

/// The plateau of a run sampled as (seconds, host memory used): the mean saving
/// (`used_before` − used) over the last [`PLATEAU_S`] seconds, bytes, and the first
/// time the saving reached 95% of it, s. memfold and KSM runs are summarised by this one
/// function.
pub fn plateau(used_before: u64, samples: impl Iterator<Item = (f64, u64)>) -> (f64, Option<f64>) {
    let saved: Vec<(f64, f64)> = samples
        .map(|(t, u)| (t, used_before as f64 - u as f64))
        .collect();
    let mean = tail_mean(&saved, |s| s.0, |s| s.1);
    // No saving, no time to reach it: with a plateau at or under 0 every sample would
    // pass "≥ 95% of it", the first one too.
    let t95 = (mean > 0.0)
        .then(|| saved.iter().find(|s| s.1 >= 0.95 * mean).map(|s| s.0))
        .flatten();
    (mean, t95)
}

/// PSI's stall total read at two instants (`us0`, `us1`, µs) as a share of the `secs`
/// between them, %; 0 for an empty window.
pub fn stall_pct(us0: u64, us1: u64, secs: f64) -> f64 {
    if secs <= 0.0 {
        return 0.0;
    }
    us1.saturating_sub(us0) as f64 / (secs * 1e6) * 100.0
}

// The agent threads' name prefix and the CPU reader live in the system layer (memfoldd
// reads them too).
pub use memfold_sys::proc::{cpu_seconds, AGENT_THREADS};

/// One second of a run.
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    /// Seconds since memfoldd started.
    pub t: f64,
    /// Host memory used by guest RAM (`memfold_vm::hostmem` for memfd RAM: the bytes
    /// allocated to the guests' memfds, memfold's pool and its store, each counted once),
    /// and memfold's own (`own_bytes`).
    pub used_bytes: u64,
    /// Of `used_bytes`, memfold's own memory: memfoldd's anonymous resident memory
    /// (`RssAnon`: its heap, not the pool and store it maps), bytes.
    pub own_bytes: u64,
    /// Not in `used_bytes`: the guests' memfold-blk processes' `RssAnon`, bytes (mostly a
    /// block device's own buffers, which the kit's QEMUs hold uncounted).
    pub blk_bytes: u64,
    /// memfoldd's statistics at that time.
    pub stats: Stats,
    /// memfoldd restarts so far in the run (deliberate kills included): a sample after a
    /// restart counts the new memfoldd's books (the gap is where this changes).
    pub daemon_restarts: u32,
    /// Managed guests whose QEMU was stopped at that time: paused by their agent failing
    /// closed (docs/security.md), not running.
    pub paused: Vec<String>,
    /// The sharing potential and what was captured of it (`--census`), when taken.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub census: Option<crate::census::SharingCensus>,
}

impl MemfoldRun {
    /// What the run captured of the sharing potential over its censuses (`--census`).
    pub fn captured(&self) -> Option<crate::census::CapturedOverTime> {
        crate::census::CapturedOverTime::of(self.samples.iter().filter_map(|s| s.census))
    }

    /// memfoldd's own memory ([`Sample::own_bytes`]), mean over the last 10 s, bytes.
    pub fn own_bytes(&self) -> f64 {
        tail_mean(&self.samples, |s| s.t, |s| s.own_bytes as f64)
    }
}

/// Each guest found paused (fail closed) in `samples`, with the time of the first sample
/// that found it so, s; in that order.
pub fn paused_since(samples: &[Sample]) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = Vec::new();
    for s in samples {
        for name in &s.paused {
            if !out.iter().any(|(n, _)| n == name) {
                out.push((name.clone(), s.t));
            }
        }
    }
    out
}

/// Self-check failures (`guest: line`, [`memfold_vm::launcher::Guest::mismatches`]) as
/// the failures they are: a mismatch, or a self-check that stalled (its memory went
/// unverified, so its 0 mismatches would prove nothing).
pub fn mismatch_failures(mismatches: &[String]) -> Vec<String> {
    mismatches
        .iter()
        .map(|l| {
            if l.contains("MEMFOLD-SELF-CHECK-STALLED") {
                format!("self-check stalled: {l}")
            } else {
                format!("self-check mismatch: {l}")
            }
        })
        .collect()
}

/// A memfold run's result.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MemfoldRun {
    /// Host memory used by guest RAM just before memfoldd started, bytes.
    pub used_before: u64,
    /// Mean over the last 10 s of (used_before − used), bytes.
    pub saved_bytes: f64,
    /// Mean over the last 10 s of memfoldd's own count (`Stats::saved_pages`: mapped −
    /// frames + reclaimed zero pages + patched, compressed and swapped pages − store
    /// pages) × 4096, bytes.
    pub books_saved_bytes: f64,
    /// Seconds until the measured saving first reached 95% of its plateau.
    pub t95_s: Option<f64>,
    /// CPU seconds used by memfoldd and the agents' threads in QEMU over the sampled
    /// window; memfoldd's census (`--census`) is in it.
    pub cpu_s: f64,
    /// CPU seconds of the managed guests' memfold-blk processes (every pid its supervisor
    /// ran, [`ProcCpu`]), beside `cpu_s`, not in it: most of it is a block device's own
    /// work (qcow2, the I/O), which a peer's guests do inside QEMU, counted on no side;
    /// memfold's read reporting and fills are in it too.
    pub blk_cpu_s: f64,
    /// Self-check mismatches the guests reported (managed and plain), `guest: line`: the
    /// sampling stops at the first, and the command fails after writing its outputs.
    pub mismatches: Vec<String>,
    /// Stopped (Ctrl-C, SIGTERM) before its `--secs`.
    pub interrupted: bool,
    /// `vm.page-cluster` (swap readahead) during the run (`None`: unreadable).
    pub page_cluster: Option<u32>,
    /// Share of the sampled window's wall time some task on the host stalled on memory
    /// (PSI's `some`), %; `None` where the kernel has no PSI.
    pub memory_stall_pct: Option<f64>,
    /// Times memfoldd died and was restarted during the run.
    pub daemon_restarts: u32,
    /// Times the run killed memfoldd on purpose (`--kill-memfoldd-every`) and restarted it.
    pub daemon_kills: u32,
    /// Samples, one per second.
    pub samples: Vec<Sample>,
    /// With `--plain-twins`: each workload's throughput, managed vs its plain twin.
    pub throughput: Vec<Throughput>,
    /// Each managed guest's workload speed late in the run ([`late_rates`]).
    pub rates: Vec<GuestRate>,
    /// With `--break-sharing`: each guest's workload speed before and after the break
    /// ([`around_break`]).
    pub around_break: Vec<AroundBreak>,
    /// How each managed guest's agent took its R bits, as it logged (`pagemap`, or
    /// `userfault` when asked for it or fallen back to it).
    pub clock_rbits: std::collections::BTreeMap<String, &'static str>,
    /// With `--compress-backing zswap`: the compressor the run turned zswap on with.
    pub backing_compressor: Option<String>,
}

impl MemfoldRun {
    /// Why the run is not a clean measurement of the whole set: self-check mismatches,
    /// guests paused (fail closed), workloads whose speed was not measured, an early
    /// stop. Empty: a clean run. `compare.json` records them and `memfold tradeoff` never
    /// picks a marked side as best.
    pub fn marks(&self) -> Vec<String> {
        let mut m = self.failures();
        m.extend(rates::unmeasured(&self.throughput));
        if self.interrupted {
            m.push("stopped before its --secs (Ctrl-C or SIGTERM)".into());
        }
        m
    }

    /// The marks that fail `run` and `compare` once their outputs are written: a guest's
    /// memory read wrong, or a guest paused, after which the set measured is not the one
    /// asked for (its slowdown counts only the rounds before the pause).
    pub fn failures(&self) -> Vec<String> {
        let mut m = mismatch_failures(&self.mismatches);
        m.extend(paused_since(&self.samples).into_iter().map(|(g, t)| {
            format!("guest {g} paused (fail closed) from {t:.0} s: its agent stopped its QEMU")
        }));
        m
    }

    /// memfoldd's statistics at the last sample (the run's end).
    pub fn end(&self) -> Option<&Stats> {
        self.samples.last().map(|s| &s.stats)
    }

    /// Per managed guest, the time its threads waited on its agent's fault service over
    /// the sampled seconds, % of those seconds ([`memfold_wire::OpLatencies::guest_wait_us`]:
    /// CoW breaks, missing faults, the clock's R/M faults, decodes; a lower bound). The
    /// host's memory-stall share (PSI) does not see a thread waiting on a userfaultfd, so
    /// this is memfold's counterpart of it; their sum bounds a host-wide "some" share
    /// from above. Empty with fewer than two samples.
    pub fn guest_wait_pct(&self) -> BTreeMap<String, f64> {
        let (Some(a), Some(b)) = (self.samples.first(), self.samples.last()) else {
            return BTreeMap::new();
        };
        let span_us = (b.t - a.t) * 1e6;
        if span_us <= 0.0 {
            return BTreeMap::new();
        }
        b.stats
            .vms
            .iter()
            .map(|v| {
                let before = a
                    .stats
                    .vms
                    .iter()
                    .find(|w| w.name == v.name)
                    .map_or(0.0, |w| w.latency.guest_wait_us());
                let waited = (v.latency.guest_wait_us() - before).max(0.0);
                (v.name.clone(), waited / span_us * 100.0)
            })
            .collect()
    }
}
/// CPU seconds of the kernel threads whose name starts with one of `prefixes` (`ksmd`,
/// `kswapd`), summed.
pub fn kernel_threads_cpu_seconds(prefixes: &[&str]) -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    dir.flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
            let comm = comm.trim();
            prefixes.iter().any(|p| comm.starts_with(p)).then_some(pid)
        })
        .map(|pid| cpu_seconds(pid, None))
        .sum()
}

/// CPU seconds of the agents' threads in `guests`, summed.
pub fn agents_cpu_seconds(guests: &[Guest]) -> f64 {
    guests
        .iter()
        .map(|g| cpu_seconds(g.pid, Some(AGENT_THREADS)))
        .sum()
}

/// What memfold cost the guests in events, all guests, cumulative.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct GuestEvents {
    /// Pages shared.
    pub shares: u64,
    /// Of those, shares asked the moment a disk read filled the page (Satori §4.1).
    pub read_shares: u64,
    /// Of those, reads filled from frames holding their base blocks, without the disk
    /// (Satori §5.2).
    pub read_fills: u64,
    /// Copy-on-write breaks of shared pages.
    pub cow_breaks: u64,
    /// Copies avoided (Satori §4.3): shared pages freed by the guest and discarded, by its
    /// VMM (free page reporting, a balloon) or by memfold's free-page discard, and shared
    /// pages a device's write overwrote whole (broken without a copy).
    pub cow_copies_avoided: u64,
    /// Free pages an enlightened guest reported, discarded without a copy (issue 17).
    pub free_discards: u64,
    /// Of those, pages that were stored: blobs released.
    pub free_discards_stored: u64,
    /// Zero pages reclaimed.
    pub reclaims: u64,
    /// Reclaimed zero pages filled again on access.
    pub refills: u64,
    /// Pages the sharing scan left alone as modified (C1).
    pub hot_skipped: u64,
    /// The clock's minor faults (R bits).
    pub minor_faults: u64,
    /// Write-protect faults (the clock's M bits and CoW breaks).
    pub wp_faults: u64,
    /// Patched or compressed pages decoded back on access.
    pub unstashes: u64,
    /// Runs of pages the agents' clock scans zapped (each a `MADV_DONTNEED` and a
    /// remove event in a QEMU).
    pub clock_zaps: u64,
    /// Runs the clock scans left alone, none of their pages mapped (`pagemap` mode).
    pub clock_zaps_skipped: u64,
}

impl GuestEvents {
    /// The events of every guest in `s`.
    pub fn of(s: &Stats) -> Self {
        let sum = |f: fn(&VmStats) -> u64| s.vms.iter().fold(0u64, |a, v| a.saturating_add(f(v)));
        GuestEvents {
            shares: sum(|v| v.shares),
            read_shares: sum(|v| v.read_shares),
            read_fills: sum(|v| v.read_fills),
            cow_breaks: sum(|v| v.cow_breaks),
            // Counters the agents report: a wild one must not panic the summary.
            cow_copies_avoided: sum(|v| {
                v.cow_copies_avoided
                    .saturating_add(v.free_discards_shared)
                    .saturating_add(v.nocopy_breaks)
            }),
            free_discards: sum(|v| v.free_discards),
            free_discards_stored: sum(|v| v.free_discards_stored),
            reclaims: sum(|v| v.reclaims),
            refills: sum(|v| v.refills),
            hot_skipped: sum(|v| v.hot_skipped),
            minor_faults: sum(|v| v.minor_faults),
            wp_faults: sum(|v| v.wp_faults),
            unstashes: sum(|v| v.unstashes),
            clock_zaps: sum(|v| v.clock_zaps),
            clock_zaps_skipped: sum(|v| v.clock_zaps_skipped),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stalled_self_check_fails_as_a_stall_not_a_mismatch() {
        let f = mismatch_failures(&[
            "web-1: MEMFOLD-MISMATCH /tmp/check/r0.md5".into(),
            "db-1: MEMFOLD-SELF-CHECK-STALLED: no new self-check pass for 301 s".into(),
        ]);
        assert!(f[0].starts_with("self-check mismatch: web-1"), "{f:?}");
        assert!(f[1].starts_with("self-check stalled: db-1"), "{f:?}");
    }

    #[test]
    fn plateau_is_the_mean_of_the_last_ten_seconds_and_t95_its_first_reach() {
        // Used falls from 1000 by 100 a second to 200, then stays: saved 800 at the end.
        let samples = (1..=30).map(|t| (t as f64, 1000u64.saturating_sub(100 * t).max(200)));
        let (saved, t95) = plateau(1000, samples);
        assert_eq!(saved, 800.0);
        assert_eq!(t95, Some(8.0), "saved 800 ≥ 95% of 800 first at 8 s");
        let id = |x: &f64| *x;
        assert_eq!(tail_mean(&[1.0, 2.0, 3.0], id, id), 2.0, "all within 10 s");
        assert_eq!(tail_mean(&[] as &[f64], id, id), 0.0);
        // A loaded host sampling every 5 s: the last 10 s hold two samples, not ten.
        let slow: Vec<(f64, f64)> = (0..20).map(|k| (k as f64 * 5.0, k as f64)).collect();
        assert_eq!(
            tail_mean(&slow, |s| s.0, |s| s.1),
            18.5,
            "samples at 90 and 95 s"
        );
        assert_eq!(plateau(5, std::iter::empty()), (0.0, None));
        // Usage that creeps up: no saving, so no time to 95% of it (every sample was "≥
        // 95%" of a negative plateau, the first at 1 s).
        let creeping = (1..=30).map(|t| (t as f64, 1000 + 10 * t as u64));
        let (saved, t95) = plateau(1000, creeping);
        assert!(saved < 0.0);
        assert_eq!(t95, None);
        // The stall share of a window: 0.5 s in 240 s is 0.21%; none for no window.
        assert!((stall_pct(1_000, 501_000, 240.0) - 0.2083).abs() < 1e-3);
        assert_eq!(stall_pct(7, 5, 10.0), 0.0);
        assert_eq!(stall_pct(0, 5, 0.0), 0.0);
        assert_eq!(
            saved_mib_over_time(3 << 20, [(1.0, 1 << 20)].into_iter()),
            [(1.0, 2.0)]
        );
    }

    #[test]
    fn guest_waits_are_the_sampled_seconds_share_per_guest() {
        let vm = |name: &str, fault_us: f64, track_us: f64| {
            let mut v = memfold_wire::VmStats {
                name: name.into(),
                ..Default::default()
            };
            v.latency.fault.total_us = fault_us;
            v.latency.track.total_us = track_us;
            v
        };
        let sample = |t: f64, vms: Vec<memfold_wire::VmStats>| Sample {
            t,
            used_bytes: 0,
            own_bytes: 0,
            blk_bytes: 0,
            stats: Stats {
                vms,
                ..Default::default()
            },
            daemon_restarts: 0,
            paused: vec![],
            census: None,
        };
        let run = MemfoldRun {
            samples: vec![
                // Boot's first touches before the first sample do not count.
                sample(1.0, vec![vm("a", 500_000.0, 0.0)]),
                sample(
                    11.0,
                    vec![vm("a", 600_000.0, 100_000.0), vm("b", 0.0, 50_000.0)],
                ),
            ],
            ..Default::default()
        };
        let w = run.guest_wait_pct();
        // a: 0.2 s of 10 s; b (attached since): 0.05 s.
        assert!(
            (w["a"] - 2.0).abs() < 1e-9 && (w["b"] - 0.5).abs() < 1e-9,
            "{w:?}"
        );
        assert!(MemfoldRun::default().guest_wait_pct().is_empty());
    }

    /// A paused guest, a mismatch or an early stop marks a run; the first two fail it.
    #[test]
    fn a_paused_guest_marks_and_fails_a_run() {
        let mut r = MemfoldRun {
            interrupted: true,
            ..Default::default()
        };
        assert_eq!(r.failures(), Vec::<String>::new());
        assert_eq!(r.marks().len(), 1);
        r.samples.push(Sample {
            t: 12.0,
            used_bytes: 0,
            own_bytes: 0,
            blk_bytes: 0,
            stats: Stats::default(),
            daemon_restarts: 0,
            paused: vec!["web-1".into()],
            census: None,
        });
        r.mismatches.push("db-1: MEMFOLD-MISMATCH".into());
        let f = r.failures();
        assert_eq!(f.len(), 2, "{f:?}");
        assert!(f[0].contains("db-1: MEMFOLD-MISMATCH") && f[1].contains("web-1 paused"));
        assert_eq!(r.marks().len(), 3);
    }

    /// Any of the flags stops the sampling: the kit's side passes its guests' deaths and
    /// Ctrl-C, and ran its full time on Ctrl-C when only the first was looked at.
    #[test]
    fn sampling_stops_at_once_when_any_flag_is_set_or_out_of_time() {
        let (set, unset) = (AtomicBool::new(true), AtomicBool::new(false));
        every_second(None, &[&set], |_| panic!("stopped before the first second")).unwrap();
        every_second(None, &[&unset, &set], |_| {
            panic!("the second flag stops it")
        })
        .unwrap();
        every_second(Some(0), &[], |_| panic!("no time to sample")).unwrap();
    }

    /// Counters the agents report are summed without wrapping.
    #[test]
    fn guest_events_saturate_rather_than_wrap() {
        let vm = memfold_wire::VmStats {
            cow_copies_avoided: u64::MAX - 1,
            free_discards_shared: 5,
            nocopy_breaks: 5,
            shares: u64::MAX,
            ..Default::default()
        };
        let s = Stats {
            vms: vec![vm.clone(), vm],
            ..Default::default()
        };
        let e = GuestEvents::of(&s);
        assert_eq!((e.cow_copies_avoided, e.shares), (u64::MAX, u64::MAX));
    }

    #[test]
    fn a_paused_guest_is_reported_from_the_first_sample_that_found_it() {
        let sample = |t: f64, paused: &[&str]| Sample {
            t,
            used_bytes: 0,
            own_bytes: 0,
            blk_bytes: 0,
            stats: Stats::default(),
            daemon_restarts: 0,
            paused: paused.iter().map(|p| p.to_string()).collect(),
            census: None,
        };
        let samples = [
            sample(1.0, &[]),
            sample(2.0, &["web-1"]),
            sample(3.0, &["web-1", "db-1"]),
            sample(4.0, &["db-1"]),
        ];
        assert_eq!(
            paused_since(&samples),
            [("web-1".to_string(), 2.0), ("db-1".to_string(), 3.0)]
        );
        assert!(paused_since(&samples[..1]).is_empty());
    }
}
