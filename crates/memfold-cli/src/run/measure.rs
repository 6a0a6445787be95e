//! What a run measures: one sample a second of memfoldd's statistics and of the host
//! memory used by guest RAM (`memfold_vm::hostmem`), the plateau and its time to 95%,
//! CPU seconds, the guests' event counts, and with plain twins each workload's throughput
//! managed vs plain.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use memfold_vm::hostmem::{guest_ram_usage, total_used, RamUsage};
use memfold_vm::launcher::{Guest, RamBackend};
use memfold_wire::{Stats, VmStats};
use serde::Serialize;

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
        RamBackend::Anonymous | RamBackend::AnonymousNoThp => "Pss + swap",
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
/// by this one function. Pages of the guests' memfds in the kernel's swap (issue 15's
/// zswap backing) count as the host's whole zswap pool (`Zswap:` in /proc/meminfo), as
/// the peer's do (`peer.rs`): on a host where nothing else uses zswap it is theirs.
pub fn used(guests: &[Guest]) -> Result<(u64, u64)> {
    let usages = ram_usages(guests)?;
    let pool = if memfold_vm::hostmem::total_swapped(&usages) > 0 {
        memfold_sys::reclaim::zswap_pool().map_or(0, |(pool, _)| pool)
    } else {
        0
    };
    Ok((
        total_used(&usages) + pool,
        usages.iter().map(|u| u.rss).sum(),
    ))
}

/// Each guest's RAM mappings as the kernel reports them now (`memfold_vm::hostmem`).
///
/// Errors: a guest's QEMU is gone.
pub fn ram_usages(guests: &[Guest]) -> Result<Vec<RamUsage>> {
    guests
        .iter()
        .map(|g| {
            guest_ram_usage(g.pid, g.mem_bytes / 2)
                .with_context(|| format!("guest {}: QEMU gone?", g.name))
        })
        .collect()
}

/// Calls `sample` (with the time the sampling started) once a second, after the second,
/// until `secs` seconds have passed (`None`: no limit) or `stop` is set: the clock of
/// every memfold and KSM run, whose end figures are means over the last
/// [`PLATEAU_S`] seconds of samples.
pub fn every_second(
    secs: Option<u64>,
    stop: Option<&AtomicBool>,
    mut sample: impl FnMut(Instant) -> Result<()>,
) -> Result<()> {
    let start = Instant::now();
    while !stop.is_some_and(|s| s.load(Ordering::SeqCst))
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
    /// allocated to the guests' memfds, memfold's pool and its store, each counted once).
    pub used_bytes: u64,
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
    /// CPU seconds used by memfoldd and the agents' threads in QEMU.
    pub cpu_s: f64,
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

/// Seconds of workload rounds compared on each side of a sharing break.
pub const BREAK_WINDOW_S: f64 = 60.0;

/// Seconds after the break left out: the breaker's own writes, and the balloon's
/// inflation under way.
pub const BREAK_SETTLE_S: f64 = 10.0;

/// A workload's speed in one guest before and after a breaker broke its sharing: the
/// rounds that ended (by the guest's uptime, `MEMFOLD-RATE <metric> <value> at <s>`) in
/// the [`BREAK_WINDOW_S`] before the break and in the one starting [`BREAK_SETTLE_S`]
/// after it.
#[derive(Clone, Debug, Serialize)]
pub struct AroundBreak {
    /// The guest.
    pub guest: String,
    /// What the workload reports.
    pub metric: String,
    /// Mean per round before, and its rounds.
    pub before: (f64, usize),
    /// Mean per round after, and its rounds.
    pub after: (f64, usize),
    /// Two standard errors of after / before, from both windows' spreads.
    pub ratio_2se: Option<f64>,
}

/// Each guest's [`AroundBreak`] for a break at `at_s` of uptime.
pub fn around_break(guests: &[Guest], at_s: f64) -> Vec<AroundBreak> {
    let mut out = Vec::new();
    for g in guests {
        for (metric, v) in timed_rates(&g.serial()) {
            let window = |from: f64| -> Vec<f64> {
                v.iter()
                    .filter(|&&(_, t)| t >= from && t < from + BREAK_WINDOW_S)
                    .map(|&(x, _)| x)
                    .collect()
            };
            let (b, a) = (window(at_s - BREAK_WINDOW_S), window(at_s + BREAK_SETTLE_S));
            let ((mb, rb), (ma, ra)) = (mean_rel_var(&b), mean_rel_var(&a));
            out.push(AroundBreak {
                guest: g.name.clone(),
                metric,
                before: (mb, b.len()),
                after: (ma, a.len()),
                ratio_2se: rb.zip(ra).map(|(x, y)| 2.0 * (ma / mb) * (x + y).sqrt()),
            });
        }
    }
    out
}

/// The `MEMFOLD-RATE <metric> <value> at <uptime s>` values in a guest's console text,
/// by metric: (value, uptime) pairs; lines without a time are left out.
fn timed_rates(serial: &str) -> BTreeMap<String, Vec<(f64, f64)>> {
    let mut out: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for (m, v, t) in rate_lines(serial) {
        if let Some(t) = t {
            out.entry(m.to_string()).or_default().push((v, t));
        }
    }
    out
}

/// Each `MEMFOLD-RATE <metric> <value> [at <uptime s>]` line of a guest's console text
/// whose value is finite and positive: (metric, value, uptime if given and finite).
fn rate_lines(serial: &str) -> impl Iterator<Item = (&str, f64, Option<f64>)> {
    serial.lines().filter_map(|l| {
        let rest = l.split("MEMFOLD-RATE ").nth(1)?;
        let mut f = rest.split_whitespace();
        let (m, v) = (f.next()?, f.next()?.parse::<f64>().ok()?);
        let t = match (f.next(), f.next().map(str::parse::<f64>)) {
            (Some("at"), Some(Ok(t))) if t.is_finite() => Some(t),
            _ => None,
        };
        (v.is_finite() && v > 0.0).then_some((m, v, t))
    })
}

/// A workload's speed in one guest late in a run: the mean of the later half of the
/// rounds it reported (`MEMFOLD-RATE <metric> <value>`) since memfoldd started — by then
/// the balloons have settled where the claim policy puts them.
#[derive(Clone, Debug, Serialize)]
pub struct GuestRate {
    /// The guest.
    pub guest: String,
    /// What the workload reports (`cache-MiB/s`, `web-req/s`, ...).
    pub metric: String,
    /// Mean per round, in the metric's unit.
    pub mean: f64,
    /// Rounds averaged.
    pub rounds: usize,
    /// Two standard errors of the mean, relative to it (`None` under 2 rounds).
    pub rel_2se: Option<f64>,
}

/// Each guest's [`GuestRate`]s since `since` (per guest, see [`StartMark`]).
pub fn late_rates(guests: &[Guest], since: &HashMap<String, StartMark>) -> Vec<GuestRate> {
    let mut out = Vec::new();
    for g in guests {
        let from = since.get(&g.name).map_or(0, |m| m.0);
        let serial = g.serial();
        for (metric, v) in rates(serial.get(from..).unwrap_or("")) {
            let late = &v[v.len() / 2..];
            let (mean, rel_var) = mean_rel_var(late);
            out.push(GuestRate {
                guest: g.name.clone(),
                metric,
                mean,
                rounds: late.len(),
                rel_2se: rel_var.map(|r| 2.0 * r.sqrt()),
            });
        }
    }
    out
}

/// A workload's throughput in a managed guest and in its plain twin over the same run
/// (the `MEMFOLD-RATE <metric> <value>` lines the guests print, one per workload round).
#[derive(Clone, Debug, Serialize)]
pub struct Throughput {
    /// The managed guest.
    pub guest: String,
    /// Its plain twin.
    pub twin: String,
    /// What the workload reports (`web-req/s`, `pgbench-tps`, `py-req/s`).
    pub metric: String,
    /// Mean per round in the managed guest.
    pub managed: f64,
    /// Rounds reported by the managed guest.
    pub managed_rounds: usize,
    /// Mean per round in the plain twin.
    pub plain: f64,
    /// Rounds reported by the plain twin.
    pub plain_rounds: usize,
    /// `managed` / `plain`: the managed guest's speed relative to its twin's (under 1: a
    /// slowdown).
    pub ratio: f64,
    /// CPU seconds the managed guest's QEMU used over the run (memfold's agent included).
    pub managed_cpu_s: f64,
    /// Of those, CPU seconds of its memfold agent's threads: with the pair pinned to one
    /// CPU, time the guest's vCPU did not get (a lower bound of memfold's cost to it;
    /// the vCPU's own time in the kernel's fault paths is not in it). 0 for a guest of the
    /// kernel's kit (no agent).
    pub managed_agent_cpu_s: f64,
    /// CPU seconds the plain twin's QEMU used over the run.
    pub plain_cpu_s: f64,
    /// Two standard errors of [`Throughput::ratio`] (and of [`Throughput::change`]), from the spread of the rounds on
    /// each side taken as independent (delta method; pessimistic when both guests slow
    /// down together, as they do when the host is busy); `None` with fewer than two
    /// rounds on a side.
    pub change_2se: Option<f64>,
}

impl MemfoldRun {
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

impl Throughput {
    /// Managed / plain − 1 (negative: the managed guest is slower).
    pub fn change(&self) -> f64 {
        self.ratio - 1.0
    }
}

/// Mean and squared relative standard error of the mean of `v` (None below 2 values).
fn mean_rel_var(v: &[f64]) -> (f64, Option<f64>) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n.max(1.0);
    if v.len() < 2 || mean <= 0.0 {
        return (mean, None);
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, Some(var / n / (mean * mean)))
}

/// The `MEMFOLD-RATE` values in a guest's console text, by metric.
fn rates(serial: &str) -> BTreeMap<String, Vec<f64>> {
    let mut out: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (m, v, _) in rate_lines(serial) {
        out.entry(m.to_string()).or_default().push(v);
    }
    out
}

/// Where a guest stood when memfoldd started: bytes of its console text, its QEMU's CPU
/// seconds, and those of its agent's threads.
pub type StartMark = (usize, f64, f64);

/// Each guest's [`StartMark`] now, by name.
pub fn start_marks<'a>(guests: impl Iterator<Item = &'a Guest>) -> HashMap<String, StartMark> {
    guests
        .map(|g| {
            let mark = (
                g.serial().len(),
                cpu_seconds(g.pid, None),
                cpu_seconds(g.pid, Some(AGENT_THREADS)),
            );
            (g.name.clone(), mark)
        })
        .collect()
}

/// Pairs each managed guest with its plain twin and compares their rates since
/// `since` (per guest, see [`StartMark`]).
pub fn throughput(
    managed: &[Guest],
    plain: &[Guest],
    since: &HashMap<String, StartMark>,
) -> Vec<Throughput> {
    let at_start = |g: &Guest| since.get(&g.name).copied().unwrap_or((0, 0.0, 0.0));
    let cpu = |g: &Guest| cpu_seconds(g.pid, None) - at_start(g).1;
    let agent_cpu = |g: &Guest| cpu_seconds(g.pid, Some(AGENT_THREADS)) - at_start(g).2;
    let window = |g: &Guest| {
        let s = g.serial();
        rates(s.get(at_start(g).0..).unwrap_or(""))
    };
    let mut out = Vec::new();
    for (m, p) in managed.iter().zip(plain) {
        let (rm, rp) = (window(m), window(p));
        for (metric, vm) in &rm {
            let Some(vp) = rp.get(metric) else { continue };
            let ((mm, rvm), (mp, rvp)) = (mean_rel_var(vm), mean_rel_var(vp));
            out.push(Throughput {
                guest: m.name.clone(),
                twin: p.name.clone(),
                metric: metric.clone(),
                managed: mm,
                managed_rounds: vm.len(),
                plain: mp,
                plain_rounds: vp.len(),
                ratio: mm / mp,
                managed_cpu_s: cpu(m),
                managed_agent_cpu_s: agent_cpu(m),
                plain_cpu_s: cpu(p),
                change_2se: rvm.zip(rvp).map(|(a, b)| 2.0 * (mm / mp) * (a + b).sqrt()),
            });
        }
    }
    out
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
}

impl GuestEvents {
    /// The events of every guest in `s`.
    pub fn of(s: &Stats) -> Self {
        let sum = |f: fn(&VmStats) -> u64| s.vms.iter().map(f).sum::<u64>();
        GuestEvents {
            shares: sum(|v| v.shares),
            read_shares: sum(|v| v.read_shares),
            read_fills: sum(|v| v.read_fills),
            cow_breaks: sum(|v| v.cow_breaks),
            cow_copies_avoided: sum(|v| {
                v.cow_copies_avoided + v.free_discards_shared + v.nocopy_breaks
            }),
            free_discards: sum(|v| v.free_discards),
            free_discards_stored: sum(|v| v.free_discards_stored),
            reclaims: sum(|v| v.reclaims),
            refills: sum(|v| v.refills),
            hot_skipped: sum(|v| v.hot_skipped),
            minor_faults: sum(|v| v.minor_faults),
            wp_faults: sum(|v| v.wp_faults),
            unstashes: sum(|v| v.unstashes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn sampling_stops_at_once_when_stopped_or_out_of_time() {
        let stop = AtomicBool::new(true);
        every_second(None, Some(&stop), |_| {
            panic!("stopped before the first second")
        })
        .unwrap();
        every_second(Some(0), None, |_| panic!("no time to sample")).unwrap();
    }

    #[test]
    fn a_paused_guest_is_reported_from_the_first_sample_that_found_it() {
        let sample = |t: f64, paused: &[&str]| Sample {
            t,
            used_bytes: 0,
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

    #[test]
    fn two_standard_errors_of_the_mean() {
        let (m, rv) = mean_rel_var(&[9.0, 11.0]);
        assert_eq!(m, 10.0);
        // s = sqrt(2), s.e. = 1, relative 0.1, squared 0.01.
        assert!((rv.unwrap() - 0.01).abs() < 1e-12);
        assert_eq!(mean_rel_var(&[5.0]).1, None, "one round has no spread");
    }

    #[test]
    fn rate_lines_are_read_by_metric_and_junk_is_skipped() {
        let serial = "boot\nMEMFOLD-RATE web-req/s 12.50\n[ 3.1] x MEMFOLD-RATE pgbench-tps 88\n\
                      MEMFOLD-RATE web-req/s 7.5\nMEMFOLD-RATE web-req/s nan\nMEMFOLD-RATE py-req/s\n\
                      MEMFOLD-RATE web-req/s -1\n";
        let r = rates(serial);
        assert_eq!(r["web-req/s"], vec![12.5, 7.5]);
        let timed = timed_rates(
            "MEMFOLD-RATE cache-MiB/s 60.5 at 101.25\nMEMFOLD-RATE cache-MiB/s 70\n\
             MEMFOLD-RATE cache-MiB/s 80 at soon\nMEMFOLD-RATE cache-MiB/s 90 at 140.0\n",
        );
        assert_eq!(timed["cache-MiB/s"], vec![(60.5, 101.25), (90.0, 140.0)]);
        assert_eq!(r["pgbench-tps"], vec![88.0]);
        assert_eq!(r.len(), 2);
    }
}
