//! `memfold run`: the main job. Boots a guest set with memfold's agent in each QEMU, starts
//! memfoldd (the Difference Engine policy unless `--policy` says otherwise), and shows
//! live per guest and in total what it saves, by mechanism, measured with the
//! one host-memory definition (`memfold_vm::hostmem`) that `memfold ksm` uses too.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use memfold_live::daemon::ZeroPolicy;
use memfold_vm::launcher::{agent_env, Guest, RamBackend};
use memfold_wire::{SavedBy, Stats, SwapStats, VmStats};
use serde::Serialize;

use crate::guests;
use crate::plot::{self, Panel, Series};

const MIB: f64 = 1048576.0;

/// `pages` 4 KiB pages in MiB.
fn pages_mib(pages: i64) -> f64 {
    pages as f64 * 4096.0 / MIB
}
/// Name prefix of the agent's threads inside QEMU.
const AGENT_THREADS: &str = "memfold-";

/// Arguments of `memfold run`.
#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    /// The guests.
    #[command(flatten)]
    pub set: guests::GuestSetArgs,
    /// Seconds memfoldd runs before the command stops everything (0: until Ctrl-C).
    #[arg(long, default_value_t = 120)]
    pub secs: u64,
    /// memfoldd's scan rate, pages/s (0: full speed).
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
    /// Zero pages: reclaim (punch out, refill on access), share (one zero frame, ESX) or
    /// keep (Satori §4.1).
    #[arg(long, value_enum, default_value_t = ZeroPolicy::Reclaim)]
    pub zero: ZeroPolicy,
    /// NRU clock (DE §4.2): seconds for its hand to pass over each guest once (R/M
    /// tracking by minor and write-protect faults); 0: off, unless the policy patches or
    /// compresses (then 4 s, DE's rescan interval).
    #[arg(long, default_value_t = 0.0)]
    pub clock_secs: f64,
    /// Which mechanisms may touch pages of each NRU class (DE §4.2): `sharing` (what
    /// ESX and KSM do), `de` (the Difference Engine: sharing, patching, compression),
    /// `aggressive` (every page as C4), or one mechanism alone.
    #[arg(long, default_value = "de", value_parser = clap::builder::PossibleValuesParser::new(memfold_core::Policy::NAMES))]
    pub policy: String,
    /// Host memory budget for the guests' RAM, MiB (DE §4.6): over it, memfoldd swaps
    /// cold pages out to a swap file in the output folder (turns the clock on). Guests
    /// whose RAM together exceeds it keep running: overcommit.
    #[arg(long)]
    pub host_budget_mib: Option<u64>,
    /// Swap file capacity, MiB (with --host-budget-mib).
    #[arg(long, default_value_t = 1024)]
    pub swap_mib: u64,
    /// Page compressor for cold pages (DE §3.3): zstd (level 1), lz4, lzo or wkdm.
    #[arg(long, default_value = "zstd")]
    pub compress_codec: memfold_core::CompressCodec,
    /// Largest compressed page kept, bytes (DE §3.3's cut-off).
    #[arg(long, default_value_t = 2048)]
    pub compress_cutoff: usize,
    /// Largest patch kept, bytes (DE §3.2's cut-off).
    #[arg(long, default_value_t = 2048)]
    pub patch_cutoff: usize,
    /// Boot beside each guest a twin of its profile that memfold does not manage (no
    /// agent) and report each workload's throughput, managed vs plain, over the same
    /// seconds on the same host (guest overhead, side by side); each pair is pinned to
    /// one host CPU. Memory figures count the managed guests only.
    #[arg(long)]
    pub plain_twins: bool,
    /// With --plain-twins: boot the plain twin of each pair first (the managed one
    /// second), to tell an order effect from memfold's.
    #[arg(long, requires = "plain_twins")]
    pub plain_first: bool,
}

impl RunArgs {
    /// The clock interval memfoldd gets, s: as given, or 4 s for a policy that needs it.
    pub fn clock_interval_s(&self) -> f64 {
        let needs = memfold_core::Policy::by_name(&self.policy).is_some_and(|p| p.needs_clock())
            || self.host_budget_mib.is_some();
        if self.clock_secs <= 0.0 && needs {
            4.0
        } else {
            self.clock_secs
        }
    }
}

/// One second of a run.
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    /// Seconds since memfoldd started.
    pub t: f64,
    /// Host memory used by guest RAM (Pss + swap over guests, pool mappings included), bytes.
    pub used_bytes: u64,
    /// memfoldd's statistics at that time.
    pub stats: Stats,
}

/// A memfold run's result.
#[derive(Clone, Debug, Serialize)]
pub struct MemfoldRun {
    /// Host memory used by guest RAM just before memfoldd started, bytes.
    pub used_before: u64,
    /// Mean over the last 10 s of (used_before − used), bytes.
    pub saved_bytes: f64,
    /// Mean over the last 10 s of memfoldd's own count (mapped − frames) × 4096, bytes.
    pub books_saved_bytes: f64,
    /// Seconds until the measured saving first reached 95% of its plateau.
    pub t95_s: Option<f64>,
    /// CPU seconds used by memfoldd and the agents' threads in QEMU.
    pub cpu_s: f64,
    /// Samples, one per second.
    pub samples: Vec<Sample>,
    /// With `--plain-twins`: each workload's throughput, managed vs its plain twin.
    pub throughput: Vec<Throughput>,
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
    /// CPU seconds the managed guest's QEMU used over the run (its agent included).
    pub managed_cpu_s: f64,
    /// Of those, CPU seconds of its memfold agent's threads: with the pair pinned to one
    /// CPU, time the guest's vCPU did not get (a lower bound of memfold's cost to it;
    /// the vCPU's own time in the kernel's fault paths is not in it).
    pub managed_agent_cpu_s: f64,
    /// CPU seconds the plain twin's QEMU used over the run.
    pub plain_cpu_s: f64,
    /// Two standard errors of [`Throughput::change`], from the spread of the rounds on
    /// each side taken as independent (delta method; pessimistic when both guests slow
    /// down together, as they do when the host is busy); `None` with fewer than two
    /// rounds on a side.
    pub change_2se: Option<f64>,
}

impl Throughput {
    /// Managed / plain − 1 (negative: the managed guest is slower).
    pub fn change(&self) -> f64 {
        self.managed / self.plain - 1.0
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
    for l in serial.lines() {
        let Some(rest) = l.split("MEMFOLD-RATE ").nth(1) else {
            continue;
        };
        let mut f = rest.split_whitespace();
        if let (Some(m), Some(Ok(v))) = (f.next(), f.next().map(str::parse::<f64>)) {
            if v.is_finite() && v > 0.0 {
                out.entry(m.to_string()).or_default().push(v);
            }
        }
    }
    out
}

/// Where a guest stood when memfoldd started: bytes of its console text, its QEMU's CPU
/// seconds, and those of its agent's threads.
type StartMark = (usize, f64, f64);

/// Pairs each managed guest with its plain twin and compares their rates since
/// `since` (per guest, see [`StartMark`]).
fn throughput(
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
                managed_cpu_s: cpu(m),
                managed_agent_cpu_s: agent_cpu(m),
                plain_cpu_s: cpu(p),
                change_2se: rvm.zip(rvp).map(|(a, b)| 2.0 * (mm / mp) * (a + b).sqrt()),
            });
        }
    }
    out
}

/// The agent library and memfoldd, installed beside the `memfold` binary.
fn companions() -> Result<(PathBuf, PathBuf)> {
    let exe = std::env::current_exe().context("cannot find the memfold binary")?;
    let agent = exe.with_file_name("libmemfold_agent.so");
    let daemon = exe.with_file_name("memfoldd");
    for p in [&agent, &daemon] {
        anyhow::ensure!(
            p.exists(),
            "{} is missing: build the whole workspace (`cargo build --release --workspace`; make main does)",
            p.display()
        );
    }
    Ok((agent, daemon))
}

/// CPU seconds (user + system) of process `pid`, or only of its threads whose name starts
/// with `thread_prefix`.
pub fn cpu_seconds(pid: u32, thread_prefix: Option<&str>) -> f64 {
    let tck = 100.0; // USER_HZ on Linux x86_64
    let ticks = |stat: &str| -> f64 {
        let rest = stat.rsplit_once(") ").map_or("", |r| r.1);
        let f: Vec<&str> = rest.split_whitespace().collect();
        // utime and stime are fields 14 and 15 of stat, 12 and 13 after "pid (comm) ".
        f.get(11).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
            + f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
    };
    match thread_prefix {
        None => {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(0.0, |s| ticks(&s) / tck)
        }
        Some(prefix) => std::fs::read_dir(format!("/proc/{pid}/task"))
            .map(|d| {
                d.flatten()
                    .filter(|t| {
                        std::fs::read_to_string(t.path().join("comm"))
                            .is_ok_and(|c| c.starts_with(prefix))
                    })
                    .map(|t| {
                        std::fs::read_to_string(t.path().join("stat")).map_or(0.0, |s| ticks(&s))
                    })
                    .sum::<f64>()
                    / tck
            })
            .unwrap_or(0.0),
    }
}

/// Kills memfoldd when dropped.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Boots the set with agents, waits for it to settle, starts memfoldd and samples every
/// second for `secs` (0: until `stop`), printing the live view.
pub fn measure(a: &RunArgs, default_out: &str, stop: &AtomicBool) -> Result<(MemfoldRun, PathBuf)> {
    let (agent, daemon_bin) = companions()?;
    let out = a
        .set
        .out
        .clone()
        .unwrap_or_else(|| crate::default_out(default_out));
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let socket = std::fs::canonicalize(&out)?.join("memfoldd.sock");
    let mut set = a.set.clone();
    if a.plain_twins {
        // web,db → web,web,db,db: web-1 managed, web-2 its plain twin, ...
        set.profiles = set
            .profiles
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .flat_map(|p| [p, p])
            .collect::<Vec<_>>()
            .join(",");
    }
    // Without twins every guest is managed; with them, the odd-numbered ones (the even
    // ones with --plain-first).
    let managed = |name: &str| {
        !a.plain_twins
            || name
                .rsplit('-')
                .next()
                .and_then(|n| n.parse::<u32>().ok())
                .is_some_and(|n| (n % 2 == 1) != a.plain_first)
    };
    let (all, _accel, out) = guests::start_set_with(&set, RamBackend::Memfd, default_out, |s| {
        if managed(&s.name) {
            agent_env(&agent, &socket, s)
        } else {
            Vec::new()
        }
    })?;
    let (mut guests, mut plain): (Vec<Guest>, Vec<Guest>) =
        all.into_iter().partition(|g| managed(&g.name));
    if a.plain_twins {
        // Each pair shares one host CPU: equal shares, and the agent's CPU time is the
        // managed guest's cost (unpinned, the scheduler gave managed QEMUs 30-45% more).
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        for (i, (m, p)) in guests.iter().zip(&plain).enumerate() {
            for g in [m, p] {
                g.pin_to_cpu(i % cpus)
                    .with_context(|| format!("cannot pin {} to CPU {}", g.name, i % cpus))?;
            }
        }
    }
    let since: HashMap<String, StartMark> = guests
        .iter()
        .chain(&plain)
        .map(|g| {
            let mark = (
                g.serial().len(),
                cpu_seconds(g.pid, None),
                cpu_seconds(g.pid, Some(AGENT_THREADS)),
            );
            (g.name.clone(), mark)
        })
        .collect();
    let used_before = crate::ksm::used(&guests)?.0;
    let mut cmd = Command::new(&daemon_bin);
    cmd.arg("--socket")
        .arg(&socket)
        .args(["--rate", &a.rate.to_string()])
        .args(["--zero", zero_arg(a.zero)])
        .args([
            "--clock-interval-ms",
            &((a.clock_interval_s() * 1000.0) as u64).to_string(),
        ])
        .args(["--policy", &a.policy])
        .args(["--compress-codec", a.compress_codec.name()])
        .args(["--compress-cutoff", &a.compress_cutoff.to_string()])
        .args(["--patch-cutoff", &a.patch_cutoff.to_string()]);
    if let Some(b) = a.host_budget_mib {
        cmd.args(["--host-budget-mib", &b.to_string()])
            .args(["--swap-mib", &a.swap_mib.to_string()])
            .arg("--swap-file")
            .arg(out.join("memfoldd.swap"));
    }
    let log = std::fs::File::create(out.join("memfoldd.log"))?;
    cmd.stderr(log);
    let daemon = Daemon(
        cmd.spawn()
            .with_context(|| format!("cannot start {}", daemon_bin.display()))?,
    );
    let dpid = daemon.0.id();
    let agent_cpu0: f64 = guests.iter().map(|g| since[&g.name].2).sum();
    let start = Instant::now();
    let mut samples: Vec<Sample> = Vec::new();
    eprintln!(
        "memfoldd running (pid {dpid}); host memory used by guest RAM before: {:.1} MiB. Ctrl-C stops.",
        used_before as f64 / MIB
    );
    while !stop.load(Ordering::SeqCst)
        && (a.secs == 0 || start.elapsed() < Duration::from_secs(a.secs))
    {
        std::thread::sleep(Duration::from_secs(1));
        for g in guests.iter_mut().chain(plain.iter_mut()) {
            g.check_alive()?;
            anyhow::ensure!(
                g.mismatches().is_empty(),
                "guest {} self-check failed: {:?}",
                g.name,
                g.mismatches()
            );
        }
        let Ok(stats) = memfold_live::query_stats(&socket) else {
            continue;
        };
        let s = Sample {
            t: start.elapsed().as_secs_f64(),
            used_bytes: crate::ksm::used(&guests)?.0,
            stats,
        };
        print_view(used_before, &s, samples.last());
        samples.push(s);
    }
    let cpu_s = cpu_seconds(dpid, None)
        + guests
            .iter()
            .map(|g| cpu_seconds(g.pid, Some(AGENT_THREADS)))
            .sum::<f64>()
        - agent_cpu0;
    drop(daemon);
    let throughput = throughput(&guests, &plain, &since);
    for g in guests.iter_mut().chain(plain.iter_mut()) {
        anyhow::ensure!(
            g.mismatches().is_empty(),
            "guest {} self-check failed: {:?}",
            g.name,
            g.mismatches()
        );
        g.stop();
    }
    let (saved_bytes, t95_s) =
        crate::ksm::plateau(used_before, samples.iter().map(|s| (s.t, s.used_bytes)));
    let books_saved_bytes =
        crate::ksm::tail_mean(&samples, |s| s.stats.saved_pages as f64 * 4096.0);
    Ok((
        MemfoldRun {
            used_before,
            saved_bytes,
            books_saved_bytes,
            t95_s,
            cpu_s,
            samples,
            throughput,
        },
        out,
    ))
}

fn zero_arg(z: ZeroPolicy) -> &'static str {
    match z {
        ZeroPolicy::Reclaim => "reclaim",
        ZeroPolicy::Share => "share",
        ZeroPolicy::Keep => "keep",
    }
}

fn print_view(used_before: u64, s: &Sample, prev: Option<&Sample>) {
    let dt = prev.map_or(1.0, |p| (s.t - p.t).max(0.001));
    let by = &s.stats.saved_by;
    eprintln!(
        "t={:>5.0}s  host {:>7.1} MiB  saved {:>7.1} MiB (books {:>7.1}: share {:.1}, zero {:.1}, patch {:.1}, compress {:.1}, swap {:.1})  frames {:>7}  scans {}{}",
        s.t,
        s.used_bytes as f64 / MIB,
        (used_before as f64 - s.used_bytes as f64) / MIB,
        pages_mib(s.stats.saved_pages),
        pages_mib(by.sharing),
        pages_mib(by.zero),
        pages_mib(by.patching),
        pages_mib(by.compression),
        pages_mib(by.swap),
        s.stats.frames,
        s.stats.full_scans,
        budget_view(&s.stats.swap)
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
        eprintln!(
            "    {:<14} {:>7} pages  shared {:>7}  zero {:>7}{de}  CoW breaks {:>6.0}/s  faults {:>7.0}/s  scanned {:>8.0}/s{nru}",
            v.name,
            v.pages,
            v.shared_pages,
            v.zero_shared_pages + v.zero_reclaimed_pages,
            rate(|v| v.cow_breaks),
            rate(|v| v.wp_faults + v.missing_faults + v.minor_faults),
            rate(|v| v.scanned_pages)
        );
    }
}

/// The budget part of the live view: host use against the budget, the swap file.
fn budget_view(w: &SwapStats) -> String {
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

/// Writes `run.csv`, `run.json` and `run.png` for a run.
pub fn write_outputs(out: &Path, r: &MemfoldRun) -> Result<()> {
    let csv = out.join("run.csv");
    let mut f = crate::create_output(&csv)?;
    writeln!(f, "t_s,vm,pages,shared_pages,zero_shared_pages,zero_reclaimed_pages,patched_pages,compressed_pages,cow_breaks,wp_faults,missing_faults,refills,unstashes,scanned_pages,used_bytes,saved_bytes,books_saved_bytes,saved_sharing_bytes,saved_zero_bytes,saved_patching_bytes,saved_compression_bytes,swapped_pages,saved_swap_bytes")?;
    for s in &r.samples {
        for v in &s.stats.vms {
            writeln!(
                f,
                "{:.1},{},{},{},{},{},{},{},{},{},{},{},{},{},,,,,,,,{},",
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
                v.swapped_pages
            )?;
        }
        let by = &s.stats.saved_by;
        writeln!(
            f,
            "{:.1},all,,{},,{},{},{},,,,,,,{},{},{},{},{},{},{},{},{}",
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
            by.swap * 4096
        )?;
    }
    drop(f);
    let json = out.join("run.json");
    std::fs::write(&json, serde_json::to_vec_pretty(r)?)
        .with_context(|| format!("cannot write {}", json.display()))?;
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
                name: "measured (Pss before − now)".into(),
                points: r
                    .samples
                    .iter()
                    .map(|s| (s.t, (r.used_before as f64 - s.used_bytes as f64) / MIB))
                    .collect(),
            },
            Series {
                name: "memfoldd books (mapped − frames)".into(),
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
    let mechanisms: [Mechanism; 5] = [
        ("sharing", |b| b.sharing),
        ("zero pages", |b| b.zero),
        ("patching", |b| b.patching),
        ("compression", |b| b.compression),
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
    plot::panels(
        &out.join("run.png"),
        "memfold run",
        "seconds since memfoldd started",
        "MiB saved",
        &panels,
    )
}

/// Prints the agents' operation latencies (the live DE Table 2 analog).
pub fn print_latencies(s: &Stats) {
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

/// A flag set by Ctrl-C.
pub fn ctrl_c_flag() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    ctrlc::set_handler(move || s.store(true, Ordering::SeqCst))
        .context("cannot install the Ctrl-C handler")?;
    Ok(stop)
}

/// `memfold run`.
pub fn run(a: &RunArgs) -> Result<()> {
    let stop = ctrl_c_flag()?;
    let (r, out) = measure(a, "run", &stop)?;
    write_outputs(&out, &r)?;
    let summary = serde_json::json!({
        "used_before_bytes": r.used_before,
        "saved_bytes": r.saved_bytes,
        "books_saved_bytes": r.books_saved_bytes,
        "t95_s": r.t95_s,
        "cpu_s": r.cpu_s,
        "latency_us": r.samples.last().map(|s| s.stats.latency),
        "policy": a.policy,
        "saved_by_pages": r.samples.last().map(|s| s.stats.saved_by),
        "lifetime": r.samples.last().map(|s| s.stats.lifetime.clone()),
    });
    if a.set.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!(
            "memfold saved {:.1} MiB of {:.1} MiB (measured, mean of the last 10 s; memfoldd's books: {:.1} MiB); 95% of it after {} s; memfoldd + agents used {:.1} CPU s",
            r.saved_bytes / MIB,
            r.used_before as f64 / MIB,
            r.books_saved_bytes / MIB,
            r.t95_s.map_or("-".into(), |t| format!("{t:.0}")),
            r.cpu_s
        );
        if let Some(s) = r.samples.last() {
            let by = &s.stats.saved_by;
            println!(
                "by mechanism at the end (books, MiB): sharing {:.1}, zero pages {:.1}, patching {:.1}, compression {:.1}, swap {:.1}, store waste {:.1}",
                pages_mib(by.sharing),
                pages_mib(by.zero),
                pages_mib(by.patching),
                pages_mib(by.compression),
                pages_mib(by.swap),
                pages_mib(by.store_waste)
            );
            let w = &s.stats.swap;
            if w.budget_pages.is_some() {
                let ins: u64 = s.stats.vms.iter().map(|v| v.swap_ins).sum();
                let outs: u64 = s.stats.vms.iter().map(|v| v.swap_outs).sum();
                println!(
                    "host budget:{}; {outs} pages swapped out, {ins} read back, {} refused (swap file full)",
                    budget_view(w).trim_start_matches("  budget"),
                    w.full
                );
            }
            let l = &s.stats.lifetime;
            if l.restored + l.stashed_now > 0 {
                println!(
                    "patched/compressed pages: {} decoded back, {} still stored; {:.0}% lived ≥ 10 s",
                    l.restored,
                    l.stashed_now,
                    l.lived_10s * 100.0
                );
            }
            print_churn(&s.stats);
            print_latencies(&s.stats);
        }
        if !r.throughput.is_empty() {
            println!("workload throughput over the run, managed guest vs its plain twin (mean per round):");
            for t in &r.throughput {
                println!(
                    "  {:<12} {:<12} {:>10.2} ({:>3} rounds, {:>5.0} CPU s, agent {:.1})  vs {:<12} {:>10.2} ({:>3} rounds, {:>5.0} CPU s)  {:+.1}%{}",
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
                    t.change() * 100.0,
                    t.change_2se
                        .map_or(String::new(), |e| format!(" ± {:.1}% (2 s.e.)", e * 100.0))
                );
            }
        }
        println!(
            "time series: {}, {}",
            out.join("run.csv").display(),
            out.join("run.png").display()
        );
    }
    Ok(())
}

/// What memfold cost the guests in events (all guests, cumulative): the churn of sharing
/// and zero reclaim, the clock's tracking faults and decodes back.
fn print_churn(s: &Stats) {
    let sum = |f: fn(&VmStats) -> u64| s.vms.iter().map(f).sum::<u64>();
    println!(
        "guest events: {} shares, {} CoW breaks, {} zero reclaims, {} refills, {} C1 pages left unshared; clock faults {} minor (R), {} write-protect; {} decoded back",
        sum(|v| v.shares),
        sum(|v| v.cow_breaks),
        sum(|v| v.reclaims),
        sum(|v| v.refills),
        sum(|v| v.hot_skipped),
        sum(|v| v.minor_faults),
        sum(|v| v.wp_faults),
        sum(|v| v.unstashes),
    );
}

#[cfg(test)]
mod tests {
    use super::{mean_rel_var, rates};

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
        assert_eq!(r["pgbench-tps"], vec![88.0]);
        assert_eq!(r.len(), 2);
    }
}
