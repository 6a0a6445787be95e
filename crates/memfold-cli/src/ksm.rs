//! `memfold ksm`: a guest set under Linux KSM, measured the way memfold is measured
//! (`memfold_vm::hostmem`).

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use memfold_sys::ksm::{Ksm, KsmMode, KsmStats};
use memfold_vm::launcher::{Guest, RamBackend};
use serde::Serialize;

use crate::guests;
use crate::plot::{self, Panel, Series};
use crate::run::measure::{
    every_second, measured_as, plateau, saved_mib, saved_mib_over_time, tail_mean, used, MIB,
};

/// Arguments of `memfold ksm`.
#[derive(Args, Clone, Debug)]
pub struct KsmArgs {
    /// The guests.
    #[command(flatten)]
    pub set: guests::GuestSetArgs,
    /// KSM settings to run: aggressive, default, or both (one after the other, unmerging
    /// in between).
    #[arg(long, default_value = "both")]
    pub mode: String,
    /// Seconds each mode runs.
    #[arg(long, default_value_t = 90)]
    pub secs: u64,
}

/// One sample.
#[derive(Clone, Debug, Serialize)]
pub struct KsmSample {
    /// Seconds since KSM started.
    pub t: f64,
    /// KSM counters.
    pub ksm: KsmStats,
    /// Host memory used by guest RAM (`memfold_vm::hostmem` for anonymous RAM: Pss over
    /// guests, plus guest RAM's share of the zswap pool when any is swapped), and KSM's
    /// own (`own_bytes`), bytes.
    pub used_bytes: u64,
    /// Of `used_bytes`, KSM's own memory in the kernel, bytes ([`KsmStats::rmap_bytes`]):
    /// the mechanism's cost, counted as memfold's own is.
    pub own_bytes: u64,
    /// Rss of guest RAM over guests, bytes.
    pub rss_bytes: u64,
    /// The sharing potential and what KSM captured of it, when a census was taken.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub census: Option<crate::census::SharingCensus>,
}

/// One mode's run.
#[derive(Clone, Debug, Serialize)]
pub struct KsmRun {
    /// Mode name.
    pub mode: &'static str,
    /// Host memory used by guest RAM just before KSM started, bytes.
    pub used_before: u64,
    /// Mean over the last 10 s: host memory saved (used_before − used), bytes.
    pub saved_bytes: f64,
    /// Mean over the last 10 s: pages_sharing × 4096 (KSM's own count), bytes.
    pub ksm_sharing_bytes: f64,
    /// Mean over the last 10 s: KSM's own memory (its rmap items), bytes; `saved_bytes`
    /// is net of it.
    pub own_bytes: f64,
    /// Seconds until the saving first reached 95% of its plateau.
    pub t95_s: Option<f64>,
    /// CPU seconds the censuses took (`--census`): read in this process's sampling thread,
    /// they are the KSM side's cost as memfoldd's census is memfold's.
    pub census_cpu_s: f64,
    /// Stopped (Ctrl-C, SIGTERM) before its `secs`.
    pub interrupted: bool,
    /// All samples.
    pub samples: Vec<KsmSample>,
}

impl KsmRun {
    /// What KSM captured of the sharing potential over its censuses.
    pub fn captured(&self) -> Option<crate::census::CapturedOverTime> {
        crate::census::CapturedOverTime::of(self.samples.iter().filter_map(|s| s.census))
    }
}

/// Runs `census` and adds the CPU seconds this thread spent in it to `cpu_s`.
///
/// Errors: the census's.
pub fn timed<T>(cpu_s: &mut f64, census: impl FnOnce() -> Result<T>) -> Result<T> {
    let t0 = memfold_sys::proc::thread_cpu_seconds();
    let r = census();
    *cpu_s += (memfold_sys::proc::thread_cpu_seconds() - t0).max(0.0);
    r
}

/// Runs one KSM mode on running guests for `secs` (or until `stop` is set: Ctrl-C),
/// sampling every second, with a census of their memory by content every `census`
/// seconds (`crate::census`; none if `None`), its CPU counted ([`KsmRun::census_cpu_s`]).
pub fn run_mode(
    ksm: &Ksm,
    guests: &mut [Guest],
    mode: KsmMode,
    secs: u64,
    census: Option<u64>,
    stop: Option<&AtomicBool>,
) -> Result<KsmRun> {
    let used_before = used(guests)?.0 + ksm.stats()?.rmap_bytes();
    ksm.start(mode)?;
    let mut samples = Vec::new();
    let mut censuses = crate::census::CensusEvery::new(census);
    let mut census_cpu_s = 0.0;
    let mut sampled_s = 0.0;
    let stops: Vec<&AtomicBool> = stop.into_iter().collect();
    every_second(Some(secs), &stops, |start| {
        for g in guests.iter_mut() {
            g.check_alive()?;
        }
        let (u, rss) = used(guests)?;
        let t = start.elapsed().as_secs_f64();
        let stats = ksm.stats()?;
        let s = KsmSample {
            t,
            ksm: stats,
            used_bytes: u + stats.rmap_bytes(),
            own_bytes: stats.rmap_bytes(),
            rss_bytes: rss,
            census: if censuses.due(t) {
                Some(timed(&mut census_cpu_s, || {
                    crate::census::of_guests(guests)
                })?)
            } else {
                None
            },
        };
        sampled_s = t;
        eprint!(
            "\r  ksm {:<10} {:>5.0} s  saved {:>7.1} MiB  pages_sharing {:>7}   ",
            mode.name,
            s.t,
            saved_mib(used_before, s.used_bytes),
            s.ksm.pages_sharing
        );
        samples.push(s);
        Ok(())
    })?;
    eprintln!();
    let (saved_bytes, t95_s) = plateau(used_before, samples.iter().map(|s| (s.t, s.used_bytes)));
    let ksm_sharing_bytes = tail_mean(&samples, |s| s.t, |s| s.ksm.pages_sharing as f64 * 4096.0);
    let own_bytes = tail_mean(&samples, |s| s.t, |s| s.own_bytes as f64);
    Ok(KsmRun {
        mode: mode.name,
        used_before,
        saved_bytes,
        ksm_sharing_bytes,
        own_bytes,
        t95_s,
        census_cpu_s,
        interrupted: sampled_s < secs as f64 && stop.is_some_and(|s| s.load(Ordering::SeqCst)),
        samples,
    })
}

/// Writes a run set's CSV and plot.
pub fn write_outputs(out: &Path, runs: &[KsmRun]) -> Result<()> {
    let csv = out.join("ksm.csv");
    let mut f = crate::create_output(&csv)?;
    writeln!(f, "mode,t_s,used_bytes,own_bytes,rss_bytes,saved_bytes,pages_shared,pages_sharing,ksm_zero_pages,general_profit,full_scans")?;
    for r in runs {
        for s in &r.samples {
            writeln!(
                f,
                "{},{:.1},{},{},{},{},{},{},{},{},{}",
                r.mode,
                s.t,
                s.used_bytes,
                s.own_bytes,
                s.rss_bytes,
                r.used_before as i64 - s.used_bytes as i64,
                s.ksm.pages_shared,
                s.ksm.pages_sharing,
                s.ksm.ksm_zero_pages,
                s.ksm
                    .general_profit
                    .map_or(String::new(), |p| p.to_string()),
                s.ksm.full_scans
            )?;
        }
    }
    let panels = vec![Panel {
        title: "KSM: host memory saved on guest RAM".into(),
        series: runs
            .iter()
            .flat_map(|r| {
                [
                    Series {
                        // KSM runs on anonymous guest RAM.
                        name: format!(
                            "{} (measured: {}, before − now)",
                            r.mode,
                            measured_as(RamBackend::Anonymous)
                        ),
                        points: saved_mib_over_time(
                            r.used_before,
                            r.samples.iter().map(|s| (s.t, s.used_bytes)),
                        ),
                    },
                    Series {
                        name: format!("{} (pages_sharing)", r.mode),
                        points: r
                            .samples
                            .iter()
                            .map(|s| (s.t, s.ksm.pages_sharing as f64 * 4096.0 / MIB))
                            .collect(),
                    },
                ]
            })
            .collect(),
        markers: vec![],
    }];
    plot::panels(
        &out.join("ksm.png"),
        "memfold ksm",
        "seconds since KSM started",
        "MiB saved",
        &panels,
    )
}

/// `memfold ksm`.
pub fn run(a: &KsmArgs) -> Result<()> {
    let modes: Vec<KsmMode> = match a.mode.as_str() {
        "aggressive" => vec![KsmMode::AGGRESSIVE],
        "default" => vec![KsmMode::DEFAULT],
        "both" => vec![KsmMode::AGGRESSIVE, KsmMode::DEFAULT],
        m => anyhow::bail!("unknown KSM mode '{m}' (aggressive, default, both)"),
    };
    let ksm = Ksm::take_control()?;
    ksm.unmerge()?;
    let (mut gs, accel, out) = guests::start_set(&a.set, RamBackend::Anonymous, "ksm")?;
    let mut runs = Vec::new();
    for m in modes {
        runs.push(run_mode(&ksm, &mut gs, m, a.secs, None, None)?);
        ksm.unmerge()?;
        std::thread::sleep(Duration::from_secs(3));
    }
    drop(ksm); // restore the host's KSM settings before reporting
    write_outputs(&out, &runs)?;
    let mismatches = crate::run::mismatches(gs.iter());
    if a.set.json {
        let summary: Vec<_> = runs
            .iter()
            .map(|r| serde_json::json!({ "mode": r.mode, "used_before_bytes": r.used_before, "saved_bytes": r.saved_bytes, "ksm_sharing_bytes": r.ksm_sharing_bytes, "t95_s": r.t95_s }))
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({ "guests": a.set.profiles, "accel": format!("{accel:?}"), "runs": summary, "guest_mismatches": mismatches })
            )?
        );
    } else {
        for r in &runs {
            println!(
                "KSM {:<10}: saved {:7.1} MiB of {:7.1} MiB used (pages_sharing: {:7.1} MiB), 95% of plateau after {}",
                r.mode,
                r.saved_bytes / MIB,
                r.used_before as f64 / MIB,
                r.ksm_sharing_bytes / MIB,
                r.t95_s.map_or("-".into(), |t| format!("{t:.0} s"))
            );
        }
        println!("guest self-check mismatches: {}", mismatches.len());
        println!(
            "time series: {}\nplot: {}",
            out.join("ksm.csv").display(),
            out.join("ksm.png").display()
        );
    }
    // A guest's memory read wrong: its figures are out, and the command fails.
    let failures = crate::run::measure::mismatch_failures(&mismatches);
    crate::run::ensure_clean("memfold ksm", &failures, &out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The census's CPU in the sampling thread goes to the KSM side; a failed census
    /// still counts what it used.
    #[test]
    fn a_census_counts_the_cpu_it_used() {
        let mut cpu = 0.0;
        let busy = |secs: f64| {
            let t0 = memfold_sys::proc::thread_cpu_seconds();
            let mut x = 0u64;
            while memfold_sys::proc::thread_cpu_seconds() - t0 < secs {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            x
        };
        timed(&mut cpu, || Ok(busy(0.05))).unwrap();
        assert!(cpu >= 0.05, "{cpu}");
        let before = cpu;
        assert!(timed(&mut cpu, || -> Result<()> {
            busy(0.02);
            anyhow::bail!("QEMU gone")
        })
        .is_err());
        assert!(cpu - before >= 0.02, "{cpu}");
    }
}
