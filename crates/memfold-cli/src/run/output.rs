//! What a run leaves: `run.csv`, `run.json` and `run.png` in the output folder, and the
//! summary on stdout (text or `--json`).

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use memfold_wire::{SavedBy, Stats, VmStats};

use super::measure::{
    measured_as, pages_mib, paused_since, saved_mib_over_time, t95_text, GuestEvents, MemfoldRun,
    Throughput, MIB,
};
use super::{measure, view, MemfoldArgs};
use crate::plot::{self, Panel, Series};

/// Writes `run.csv`, `run.json` and `run.png` for a run.
pub fn write_outputs(out: &Path, r: &MemfoldRun) -> Result<()> {
    write_csv(&out.join("run.csv"), r)?;
    let json = out.join("run.json");
    std::fs::write(&json, serde_json::to_vec_pretty(r)?)
        .with_context(|| format!("cannot write {}", json.display()))?;
    write_png(&out.join("run.png"), r)
}

/// `run.csv`: per second a row per guest and a row `all`.
fn write_csv(csv: &Path, r: &MemfoldRun) -> Result<()> {
    let mut f = crate::create_output(csv)?;
    writeln!(f, "t_s,vm,pages,shared_pages,zero_shared_pages,zero_reclaimed_pages,patched_pages,compressed_pages,cow_breaks,wp_faults,missing_faults,refills,unstashes,scanned_pages,used_bytes,saved_bytes,books_saved_bytes,saved_sharing_bytes,saved_zero_bytes,saved_patching_bytes,saved_compression_bytes,swapped_pages,saved_swap_bytes,memfoldd_restarts,entitlement_bytes,balloon_actual_bytes,shares,read_shares,read_landed,read_fills,free_reclaimed_pages,saved_free_bytes")?;
    for s in &r.samples {
        for v in &s.stats.vms {
            writeln!(
                f,
                "{:.1},{},{},{},{},{},{},{},{},{},{},{},{},{},,,,,,,,{},,{},{:.0},{},{},{},{},{},{},",
                s.t,
                v.name,
                v.pages,
                v.shared_pages,
                v.zero_shared_pages,
                v.zero_reclaimed_pages,
                v.patched_pages,
                v.compressed_pages,
                v.cow_breaks,
                v.wp_faults,
                v.missing_faults,
                v.refills,
                v.unstashes,
                v.scanned_pages,
                v.swapped_pages,
                s.daemon_restarts,
                v.entitlement_pages * 4096.0,
                v.balloon_actual_bytes
                    .map_or(String::new(), |b| b.to_string()),
                v.shares,
                v.read_shares,
                v.read_landed,
                v.read_fills,
                v.free_reclaimed_pages
            )?;
        }
        let by = &s.stats.saved_by;
        writeln!(
            f,
            "{:.1},all,,{},,{},{},{},,,,,,,{},{},{},{},{},{},{},{},{},{},{:.0},,{},{},{},{},{},{}",
            s.t,
            s.stats.mapped_pages,
            s.stats.zero_reclaimed_pages,
            s.stats.patched_pages,
            s.stats.compressed_pages,
            s.used_bytes,
            r.used_before as i64 - s.used_bytes as i64,
            s.stats.saved_pages * 4096,
            by.sharing * 4096,
            by.zero * 4096,
            by.patching * 4096,
            by.compression * 4096,
            s.stats.swap.swapped_pages,
            by.swap * 4096,
            s.daemon_restarts,
            s.stats.vms.iter().map(|v| v.entitlement_pages).sum::<f64>() * 4096.0,
            s.stats.vms.iter().map(|v| v.shares).sum::<u64>(),
            s.stats.vms.iter().map(|v| v.read_shares).sum::<u64>(),
            s.stats.vms.iter().map(|v| v.read_landed).sum::<u64>(),
            s.stats.vms.iter().map(|v| v.read_fills).sum::<u64>(),
            s.stats
                .vms
                .iter()
                .map(|v| v.free_reclaimed_pages)
                .sum::<u64>(),
            by.free * 4096
        )?;
    }
    Ok(())
}

/// `run.png`: the saving measured and by memfoldd's books, and the books by mechanism.
fn write_png(png: &Path, r: &MemfoldRun) -> Result<()> {
    let policy = r
        .samples
        .last()
        .map_or("sharing".to_string(), |s| s.stats.policy.clone());
    let by = |f: fn(&SavedBy) -> i64| -> Vec<(f64, f64)> {
        r.samples
            .iter()
            .map(|s| (s.t, pages_mib(f(&s.stats.saved_by))))
            .collect()
    };
    let mut panels = vec![Panel {
        title: format!("memfold ({policy}): host memory saved on guest RAM"),
        series: vec![
            Series {
                name: format!("measured ({}, before − now)", measured_as(super::RAM)),
                points: saved_mib_over_time(
                    r.used_before,
                    r.samples.iter().map(|s| (s.t, s.used_bytes)),
                ),
            },
            Series {
                name: "memfoldd books (all mechanisms)".into(),
                points: r
                    .samples
                    .iter()
                    .map(|s| (s.t, pages_mib(s.stats.saved_pages)))
                    .collect(),
            },
        ],
        markers: vec![],
    }];
    // DE Fig 9-11: the saving by mechanism over time.
    type Mechanism = (&'static str, fn(&SavedBy) -> i64);
    let mechanisms: [Mechanism; 7] = [
        ("sharing", |b| b.sharing),
        ("zero pages", |b| b.zero),
        ("free (guest-reported)", |b| b.free),
        ("patching", |b| b.patching),
        ("compression", |b| b.compression),
        ("zswap (kernel)", |b| b.zswap),
        ("swap", |b| b.swap),
    ];
    panels.push(Panel {
        title: "memfoldd books by mechanism".into(),
        series: mechanisms
            .iter()
            .map(|&(name, f)| Series {
                name: name.into(),
                points: by(f),
            })
            .collect(),
        markers: vec![],
    });
    // Satori §4.1: shares made the moment a disk read filled the page, apart from the
    // scan's (cumulative), when a block device reported reads.
    if r.samples
        .iter()
        .any(|s| s.stats.vms.iter().any(|v| v.read_landed > 0))
    {
        let total = |f: fn(&VmStats) -> u64| -> Vec<(f64, f64)> {
            r.samples
                .iter()
                .map(|s| (s.t, s.stats.vms.iter().map(f).sum::<u64>() as f64))
                .collect()
        };
        panels.push(Panel {
            title: "shares (pages, cumulative): at disk read vs found by the scan".into(),
            series: vec![
                Series {
                    name: "at disk read (Satori §4.1)".into(),
                    points: total(|v| v.read_shares),
                },
                Series {
                    name: "by the scan".into(),
                    points: total(|v| v.shares - v.read_shares),
                },
            ],
            markers: vec![],
        });
    }
    // Satori §6.1: the sharing potential and what was captured of it (`--census`).
    let censuses: Vec<(f64, crate::census::SharingCensus)> = r
        .samples
        .iter()
        .filter_map(|s| Some((s.t, s.census?)))
        .collect();
    if !censuses.is_empty() {
        let line = |f: fn(&crate::census::SharingCensus) -> u64| -> Vec<(f64, f64)> {
            censuses
                .iter()
                .map(|(t, c)| (*t, pages_mib(f(c) as i64)))
                .collect()
        };
        panels.push(Panel {
            title: "non-zero duplicates, MiB: the potential (census) and what sharing captured"
                .into(),
            series: vec![
                Series {
                    name: "potential".into(),
                    points: line(|c| c.potential_pages),
                },
                Series {
                    name: "captured".into(),
                    points: line(|c| c.captured_pages),
                },
            ],
            markers: vec![],
        });
    }
    // Satori §4.2: each guest's part of what sharing saves.
    let mut names: Vec<&str> = r
        .samples
        .iter()
        .flat_map(|s| s.stats.vms.iter().map(|v| v.name.as_str()))
        .collect();
    names.sort_unstable();
    names.dedup();
    // Per guest: its entitlement, and what its balloon leaves it (allowance + what it
    // claims); each panel only when some guest has more than 0.
    let per_guest = |title: &str, mib: fn(&VmStats) -> Option<f64>| -> Option<Panel> {
        let series: Vec<Series> = names
            .iter()
            .map(|&name| Series {
                name: name.into(),
                points: r
                    .samples
                    .iter()
                    .filter_map(|s| {
                        let v = s.stats.vms.iter().find(|v| v.name == name)?;
                        Some((s.t, mib(v)?))
                    })
                    .collect(),
            })
            .collect();
        let shown = series
            .iter()
            .any(|s| s.points.iter().any(|&(_, y)| y > 0.0));
        shown.then(|| Panel {
            title: title.into(),
            series,
            markers: vec![],
        })
    };
    panels.extend(per_guest(
        "sharing entitlement per guest (Satori §4.2: Σ (rank − 1) / rank)",
        |v| Some(v.entitlement_pages * 4096.0 / MIB),
    ));
    panels.extend(per_guest(
        "memory each guest has, MiB: what its balloon leaves it (allowance + claimed entitlement)",
        |v| v.balloon_actual_bytes.map(|b| b as f64 / MIB),
    ));
    plot::panels(
        png,
        "memfold run",
        "seconds since memfoldd started",
        // Saved, entitled, and (with balloons) what a guest has: all MiB.
        "MiB",
        &panels,
    )
}

/// Prints the summary of `memfold run`: JSON with `--json`, else the saving, by mechanism,
/// the budget, stored pages' lifetimes, guest events, latencies and throughput.
pub fn print_summary(a: &MemfoldArgs, r: &MemfoldRun, out: &Path) -> Result<()> {
    let summary = serde_json::json!({
        "used_before_bytes": r.used_before,
        "saved_bytes": r.saved_bytes,
        "books_saved_bytes": r.books_saved_bytes,
        "t95_s": r.t95_s,
        "cpu_s": r.cpu_s,
        "blk_cpu_s": r.blk_cpu_s,
        "page_cluster": r.page_cluster,
        "guest_mismatches": r.mismatches,
        // Why the run is not a clean measurement (mismatches, paused guests, workloads
        // not measured, an early stop); mismatches and pauses fail the command.
        "marks": r.marks(),
        "latency_us": r.end().map(|s| s.latency),
        "policy": a.engine.policy,
        "clock_rbits": a.clock_rbits,
        // The mode each agent took (an agent falls back to userfault without PAGEMAP_SCAN).
        "clock_rbits_taken": r.clock_rbits,
        "compress_backing": a.engine.compress_backing,
        "page_out_frames": a.engine.page_out_frames,
        "page_out_mapped_frames": a.engine.page_out_mapped_frames,
        // Pool frames in the kernel's swap at the end, and sent there in all.
        "frames_paged_out": r.end().map(|s| s.kernel_swap.frames_paged_out),
        "frame_page_outs": r.end().map(|s| s.kernel_swap.frame_page_outs),
        "backing_compressor": r.backing_compressor,
        "saved_by_pages": r.end().map(|s| s.saved_by),
        "memfoldd_restarts": r.daemon_restarts,
        "memfoldd_kills": r.daemon_kills,
        "held_bytes": r.end().map(|s| s.held),
        "lifetime": r.end().map(|s| s.lifetime.clone()),
        "captured": r.captured(),
        // Shares made the moment a disk read filled the page (Satori §4.1) apart from all.
        "events": r.end().map(GuestEvents::of),
        // Enlightened guests' pages by category (issue 17), by guest.
        "guest_pages": r.end().map(|s| {
            s.vms
                .iter()
                .filter_map(|v| v.guest_pages.as_ref().map(|g| (v.name.clone(), g.clone())))
                .collect::<std::collections::BTreeMap<_, _>>()
        }),
        // Each guest's waits on its agent over the sampled seconds, %, and its store
        // floor at the end (issue 15: raised while over memfoldd's --wait-target).
        "guest_wait_pct": r.guest_wait_pct(),
        "store_floor": r.end().map(|s| {
            s.vms
                .iter()
                .map(|v| (v.name.clone(), serde_json::json!({"floor": v.store_floor, "raised": v.store_floor_raised})))
                .collect::<std::collections::BTreeMap<_, _>>()
        }),
        "throughput": &r.throughput,
        "paused": paused_since(&r.samples)
            .iter()
            .map(|(name, t)| serde_json::json!({"guest": name, "since_s": t}))
            .collect::<Vec<_>>(),
    });
    if a.set.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
        return leak_check(r);
    }
    if r.daemon_kills > 0 {
        println!(
            "memfoldd was killed (SIGKILL) and restarted {} time(s) on purpose",
            r.daemon_kills
        );
    }
    if let Some(h) = r.end().map(|s| s.held) {
        println!(
            "held vs booked, MiB: pools {:.1} / {:.1}, stores {:.1} / {:.1}, swap files {:.1} / {:.1}",
            h.pool as f64 / MIB,
            h.pool_booked as f64 / MIB,
            h.store as f64 / MIB,
            h.store_booked as f64 / MIB,
            h.swap as f64 / MIB,
            h.swap_booked as f64 / MIB
        );
    }
    if r.daemon_restarts > 0 {
        println!(
            "memfoldd died and was restarted {} time(s); run.csv's memfoldd_restarts column marks where (memfoldd's books restart from zero there)",
            r.daemon_restarts
        );
    }
    println!(
        "memfold saved {:.1} MiB of {:.1} MiB (measured, mean of the last 10 s, net of memfoldd's own {:.1} MiB; memfoldd's books: {:.1} MiB); 95% of it after {} s; memfoldd + agents used {:.1} CPU s (and memfold-blk {:.1})",
        r.saved_bytes / MIB,
        r.used_before as f64 / MIB,
        r.own_bytes() / MIB,
        r.books_saved_bytes / MIB,
        t95_text(r.t95_s),
        r.cpu_s,
        r.blk_cpu_s
    );
    if let Some(c) = r.captured() {
        println!("{}", c.line());
    }
    for (name, t) in paused_since(&r.samples) {
        println!(
            "guest {name}: paused (fail closed) from {t:.0} s on: its agent stopped QEMU rather than let it run unprotected (its qemu.stderr says why); its figures since then are of a stopped guest"
        );
    }
    if let Some(s) = r.end() {
        for v in &s.vms {
            if let Some(g) = &v.guest_pages {
                println!("guest {}:{}", v.name, view::guest_pages(g));
            }
        }
        print_end_books(s);
        print_churn(s);
        print_latencies(s);
        for (name, pct) in r.guest_wait_pct() {
            let floor = s.vms.iter().find(|v| v.name == name);
            println!(
                "guest {name}: waited on its agent {pct:.2}% of the time; store floor {} idle scans (raised {} times)",
                floor.map_or(0, |v| v.store_floor),
                floor.map_or(0, |v| v.store_floor_raised)
            );
        }
    }
    print_throughput("memfold-managed", &r.throughput);
    print_rates(r);
    print_around_break(r);
    for m in r.marks() {
        println!("!! RUN MARKED: {m}");
    }
    println!(
        "time series: {}, {}",
        out.join("run.csv").display(),
        out.join("run.png").display()
    );
    leak_check(r)
}

/// Memory the pools, stores and swap files may hold past their books at the end of a run
/// before it counts as a leak, bytes (one 4 MiB growth step of a store).
const LEAK_SLACK_BYTES: i64 = 4 << 20;

/// How long a memfoldd must have run before its books count for the leak check, s: one
/// just restarted has adopted pools whose frames it books as their agents re-attach.
const LEAK_SETTLE_S: f64 = 10.0;

/// Fails if memfoldd's backings ended holding more than its books account for: in the
/// last sample of a memfoldd that had run [`LEAK_SETTLE_S`] (none: nothing to check).
fn leak_check(r: &MemfoldRun) -> Result<()> {
    let Some(h) = r
        .samples
        .iter()
        .rev()
        .find(|s| s.stats.uptime_s >= LEAK_SETTLE_S)
        .map(|s| s.stats.held)
    else {
        return Ok(());
    };
    anyhow::ensure!(
        h.unbooked() <= LEAK_SLACK_BYTES,
        "leak: memfoldd's pools, stores and swap files hold {} bytes past its books ({h:?})",
        h.unbooked()
    );
    Ok(())
}

/// memfoldd's books by mechanism, MiB (DE Fig 9–11's breakdown; "free (guest-reported)"
/// is issue 17's free-page discard), as one line's text.
pub(crate) fn mechanisms_mib(by: &SavedBy) -> String {
    format!(
        "sharing {:.1}, zero pages {:.1}, free (guest-reported) {:.1}, patching {:.1}, compression {:.1}, zswap (kernel, est.) {:.1}, swap {:.1}, store waste {:.1}",
        pages_mib(by.sharing),
        pages_mib(by.zero),
        pages_mib(by.free),
        pages_mib(by.patching),
        pages_mib(by.compression),
        pages_mib(by.zswap),
        pages_mib(by.swap),
        pages_mib(by.store_waste)
    )
}

/// The books at the end: by mechanism, the budget and swap, stored pages' lifetimes.
fn print_end_books(s: &Stats) {
    println!(
        "by mechanism at the end (books, MiB): {}",
        mechanisms_mib(&s.saved_by)
    );
    let w = &s.swap;
    if w.budget_pages.is_some() {
        let ins: u64 = s.vms.iter().map(|v| v.swap_ins).sum();
        let outs: u64 = s.vms.iter().map(|v| v.swap_outs).sum();
        println!(
            "host budget:{}; {outs} pages swapped out, {ins} read back, {} refused (swap file full)",
            view::budget(w).trim_start_matches("  budget"),
            w.full
        );
    }
    let l = &s.lifetime;
    if l.restored + l.stashed_now > 0 {
        println!(
            "patched/compressed pages: {} decoded back, {} still stored; {:.0}% lived ≥ 10 s",
            l.restored,
            l.stashed_now,
            l.lived_10s * 100.0
        );
    }
}

/// What memfold cost the guests in events (all guests, cumulative): the churn of sharing
/// and zero reclaim, the clock's tracking faults and decodes back.
fn print_churn(s: &Stats) {
    let e = GuestEvents::of(s);
    println!(
        "guest events: {} shares ({} at disk read, {} of them filled from frames), {} CoW breaks ({} copies avoided: shared pages the guest freed, dropped, or a device overwrote whole), {} zero reclaims, {} refills, {} free pages discarded ({} stored ones), {} C1 pages left unshared; clock faults {} minor (R), {} write-protect; clock zaps {} ({} runs found unmapped, left alone); {} decoded back",
        e.shares,
        e.read_shares,
        e.read_fills,
        e.cow_breaks,
        e.cow_copies_avoided,
        e.reclaims,
        e.refills,
        e.free_discards,
        e.free_discards_stored,
        e.hot_skipped,
        e.minor_faults,
        e.wp_faults,
        e.clock_zaps,
        e.clock_zaps_skipped,
        e.unstashes,
    );
}

/// Prints the agents' operation latencies (the live DE Table 2 analog).
fn print_latencies(s: &Stats) {
    println!("live operation latencies over all guests (timed by the agents):");
    println!(
        "  {:<28} {:>10} {:>9} {:>9} {:>9}",
        "operation", "count", "p50 µs", "p99 µs", "max µs"
    );
    let l = &s.latency;
    for (name, x) in [
        ("share (per page)", l.share),
        ("CoW break", l.cow_break),
        ("missing fault (zero fill)", l.fault),
        ("zero reclaim (per page)", l.reclaim),
        ("clock minor fault (R/M)", l.track),
        ("stash (per page, agent)", l.stash),
        ("decode back (missing fault)", l.unstash),
        ("patch encode (memfoldd)", l.patch_encode),
        ("compress (memfoldd)", l.compress),
    ] {
        println!(
            "  {:<28} {:>10} {:>9.1} {:>9.1} {:>9.1}",
            name, x.count, x.p50_us, x.p99_us, x.max_us
        );
    }
}

/// Each guest's workload speed late in the run, with the memory its balloon leaves it at
/// the end (when memfoldd drives one): the figures a claim policy is judged by.
fn print_rates(r: &MemfoldRun) {
    if r.rates.is_empty() {
        return;
    }
    println!("workload speed per guest, later half of its rounds (total work / total time ± 2 s.e.), and the memory it has at the end:");
    let end = r.end();
    for g in &r.rates {
        let v = end.and_then(|s| s.vms.iter().find(|v| v.name == g.guest));
        let has = v
            .and_then(|v| v.balloon_actual_bytes)
            .map_or("its whole RAM (no balloon driven)".to_string(), |b| {
                format!("{:.0} MiB (balloon)", b as f64 / MIB)
            });
        let entitled = v.map_or(0.0, |v| v.entitlement_pages * 4096.0 / MIB);
        println!(
            "  {:<12} {:<14} {:>9.2}{} ({:>3} rounds)  has {has}, entitled to {entitled:.1} MiB",
            g.guest,
            g.metric,
            g.mean,
            g.rel_2se
                .map_or(String::new(), |e| format!(" ± {:.1}%", e * 100.0)),
            g.rounds,
        );
    }
}

/// With `--break-sharing`: each guest's workload speed before and after the break.
fn print_around_break(r: &MemfoldRun) {
    if r.around_break.is_empty() {
        return;
    }
    println!(
        "workload speed per guest around the sharing break ({:.0} s before it vs {:.0} s from {:.0} s after it, by guest uptime):",
        measure::BREAK_WINDOW_S,
        measure::BREAK_WINDOW_S,
        measure::BREAK_SETTLE_S
    );
    for b in &r.around_break {
        println!(
            "  {:<12} {:<14} before {:>9.2} ({:>3} rounds)  after {:>9.2} ({:>3} rounds)  after/before {:.3}{}",
            b.guest,
            b.metric,
            b.before.0,
            b.before.1,
            b.after.0,
            b.after.1,
            b.after.0 / b.before.0,
            b.ratio_2se.map_or(String::new(), |e| format!(" ± {e:.3} (2 s.e.)")),
        );
    }
}

/// With `--plain-twins`: each workload's throughput in the guests `side` manages
/// (`memfold-managed`, `kit-managed`) against their plain twins, with the ratio managed /
/// plain ± 2 standard errors of the round-to-round noise; a workload without rounds on a
/// side is shown as not measured; nothing without twins. `memfold run` and both sides of
/// `memfold compare` print it so.
pub fn print_throughput(side: &str, throughput: &[Throughput]) {
    if throughput.is_empty() {
        return;
    }
    println!("workload throughput over the run, {side} guest vs its plain twin (total work / total time of the rounds):");
    for t in throughput {
        if !t.measured() {
            println!(
                "  {:<12} {:<12} NOT MEASURED: {} rounds managed, {} on the plain twin {}",
                t.metric, t.guest, t.managed_rounds, t.plain_rounds, t.twin
            );
            continue;
        }
        println!(
            "  {:<12} {:<12} {:>10.2} ({:>3} rounds, {:>5.0} CPU s, agent {:.1})  vs {:<12} {:>10.2} ({:>3} rounds, {:>5.0} CPU s)  ratio {:.3}{}  ({:+.1}%)",
            t.metric,
            t.guest,
            t.managed,
            t.managed_rounds,
            t.managed_cpu_s,
            t.managed_agent_cpu_s,
            t.twin,
            t.plain,
            t.plain_rounds,
            t.plain_cpu_s,
            t.ratio,
            t.change_2se
                .map_or(String::new(), |e| format!(" ± {e:.3} (2 s.e.)")),
            t.change() * 100.0,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::measure::Sample;
    use memfold_wire::VmStats;

    #[test]
    fn a_run_writes_its_csv_json_and_png() {
        let samples = (1..=3)
            .map(|t| {
                let mut stats = Stats {
                    saved_pages: 100 * t,
                    uptime_s: 30.0 + t as f64,
                    ..Stats::default()
                };
                stats.saved_by.sharing = 60 * t;
                stats.vms.push(VmStats {
                    name: "web-1".into(),
                    pages: 1000,
                    entitlement_pages: 7.5 * t as f64,
                    balloon_actual_bytes: Some((256 + t as u64) << 20),
                    ..VmStats::default()
                });
                Sample {
                    t: t as f64,
                    used_bytes: (2000 - 100 * t as u64) * 4096,
                    own_bytes: 0,
                    blk_bytes: 0,
                    stats,
                    daemon_restarts: 0,
                    paused: vec![],
                    census: None,
                }
            })
            .collect();
        let r = MemfoldRun {
            used_before: 2000 * 4096,
            saved_bytes: 0.0,
            books_saved_bytes: 0.0,
            t95_s: None,
            cpu_s: 0.0,
            blk_cpu_s: 0.0,
            mismatches: vec![],
            interrupted: false,
            page_cluster: None,
            memory_stall_pct: None,
            daemon_restarts: 0,
            daemon_kills: 0,
            samples,
            throughput: vec![],
            rates: vec![],
            around_break: vec![],
            clock_rbits: Default::default(),
            backing_compressor: None,
        };
        leak_check(&r).unwrap();
        let mut leaky = r.clone();
        let end = leaky.samples.last_mut().unwrap();
        end.stats.held.store = 4096 * 2000;
        end.stats.held.store_booked = 4096 * 900;
        let e = leak_check(&leaky).unwrap_err().to_string();
        assert!(e.contains("hold 4505600 bytes past its books"), "{e}");
        // A sample of a memfoldd restarted a second ago is not yet settled: the check
        // reads the last settled one.
        let mut restarted = r.clone();
        let mut young = restarted.samples.last().unwrap().clone();
        young.stats.uptime_s = 1.0;
        young.stats.held.store = 4096 * 2000;
        restarted.samples.push(young);
        leak_check(&restarted).unwrap();
        let dir = tempfile::tempdir().unwrap();
        write_outputs(dir.path(), &r).unwrap();
        let csv = std::fs::read_to_string(dir.path().join("run.csv")).unwrap();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(
            lines.len(),
            1 + 3 * 2,
            "header, then a guest row and `all` a second"
        );
        let columns = lines[0].split(',').count();
        assert!(lines.iter().all(|l| l.split(',').count() == columns));
        assert!(lines[1].starts_with("1.0,web-1,1000,"));
        // The guest's entitlement, 7.5 pages at 1 s, in bytes: its own row and `all`'s.
        // Then what its balloon leaves it (257 MiB at 1 s), then its shares (all, at disk
        // read), the pages a disk read filled and those filled from frames, then its
        // discarded free pages (none) and, only in `all`'s row, their saving.
        assert!(
            lines[1].ends_with(",30720,269484032,0,0,0,0,0,"),
            "{}",
            lines[1]
        );
        // used 1900 pages of 2000 at 1 s: saved 100 pages; books 100 pages, sharing 60.
        assert!(lines[2].starts_with("1.0,all,"));
        assert!(
            lines[2].ends_with(",409600,409600,245760,0,0,0,0,0,0,30720,,0,0,0,0,0,0"),
            "{}",
            lines[2]
        );
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join("run.json")).unwrap()).unwrap();
        assert_eq!(json["samples"].as_array().unwrap().len(), 3);
        assert!(std::fs::metadata(dir.path().join("run.png")).unwrap().len() > 0);
    }
}
