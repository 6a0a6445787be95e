//! The kernel's whole kit as `memfold compare`'s peer (issue 15, `--peer ksm+zswap`): KSM
//! (aggressive) for sharing, zswap for compressing what reclaim pushes out, a swap file
//! behind it, and a proactive-reclaim controller in the manner of Meta's Senpai (TMO,
//! ASPLOS 2022): the guests' QEMUs live in a memory cgroup from birth, and every
//! interval (2 s by default) the controller lowers its limit while the host's memory
//! pressure stays under a target and raises it when pressure goes over. With
//! `--peer ksm+zswap+fpr` each guest also has a virtio balloon with free page reporting:
//! its kernel reports free 2 MiB blocks and QEMU discards them from guest RAM.
//!
//! With plain twins ([`Kit::twins`]) each managed guest has an unmanaged twin beside it:
//! outside the cgroup, its RAM not mergeable (QEMU's `mem-merge=off`), no balloon; the
//! pairs' throughputs are compared as `memfold run --plain-twins` compares them.
//!
//! Host memory the peer leaves is measured like memfold's and KSM's: the Pss of guest RAM
//! (KSM-merged pages split among their mappers; pages swapped out count nothing there)
//! plus the zswap pool's own bytes (the compressed pages, not the 4 KiB they stand for).
//! Pages zswap sent on to the swap file left host memory.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use memfold_sys::ksm::{Ksm, KsmMode};
use memfold_sys::reclaim::{self, MemCgroup, SwapFile, Zswap};
use memfold_vm::launcher::{Guest, RamBackend};

use crate::run::measure::{start_marks, throughput, Throughput};
use crate::run::Twins;
use serde::Serialize;

use crate::guests::{self, GuestSetArgs};
use crate::run::cpu_seconds;
use crate::run::measure::{every_second, kernel_threads_cpu_seconds, plateau, ram_usages};

/// Compressors zswap is offered, best ratio first: the first the kernel takes is used.
pub const COMPRESSORS: [&str; 5] = ["zstd", "deflate", "lz4", "lzo-rle", "lzo"];

/// Senpai's rule: one step of the limit, bytes, from the limit now, the group's usage and
/// the memory pressure over the last interval (fraction of time some task stalled).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Senpai {
    /// Pressure to hold, fraction (0.001 = 0.1%, Senpai's default).
    pub target: f64,
    /// Most the limit drops in one interval, fraction of usage (at zero pressure).
    pub max_probe: f64,
    /// Most the limit rises in one interval, fraction of the limit.
    pub max_backoff: f64,
    /// How often the limit is set, s (Senpai's default: 6).
    pub interval_s: f64,
    /// The limit never goes under this, bytes.
    pub min_limit: u64,
}

impl Senpai {
    /// The next limit: under the target, `usage` less up to [`Senpai::max_probe`] of it,
    /// the closer to zero pressure the more; over the target, the limit raised by up to
    /// [`Senpai::max_backoff`], the further over the more. Never under
    /// [`Senpai::min_limit`].
    pub fn next(&self, limit: u64, usage: u64, pressure: f64) -> u64 {
        let next = if pressure < self.target {
            let adj = (self.target - pressure) / self.target * self.max_probe;
            usage.min(limit) as f64 * (1.0 - adj)
        } else {
            let adj =
                ((pressure - self.target) / self.target * self.max_backoff).min(self.max_backoff);
            limit as f64 * (1.0 + adj)
        };
        (next.round() as u64).max(self.min_limit)
    }
}

/// One sample of the peer.
#[derive(Clone, Debug, Serialize)]
pub struct PeerSample {
    /// Seconds since KSM and the controller started.
    pub t: f64,
    /// Host memory the guests' RAM takes: `pss_bytes` + `zswap_pool_bytes`.
    pub used_bytes: u64,
    /// Pss of the guests' RAM mappings, bytes.
    pub pss_bytes: u64,
    /// The zswap pool's own bytes (host-wide).
    pub zswap_pool_bytes: u64,
    /// Bytes of the pages zswap holds (uncompressed).
    pub zswapped_bytes: u64,
    /// The cgroup's swapped-out bytes (in zswap or the swap file).
    pub swapped_bytes: u64,
    /// The cgroup's usage, bytes (QEMU's own memory included).
    pub usage_bytes: u64,
    /// The cgroup's limit now, bytes.
    pub limit_bytes: u64,
    /// Host memory pressure over the last second, fraction of time some task stalled.
    pub pressure: f64,
    /// KSM's pages_sharing.
    pub pages_sharing: u64,
    /// With plain twins: Pss of the twins' guest RAM, bytes (neither merged, reclaimed nor
    /// reported; the managed guests' starting point, at the same time).
    pub plain_pss_bytes: Option<u64>,
}

/// The peer's run.
#[derive(Clone, Debug, Serialize)]
pub struct PeerRun {
    /// The controller's settings.
    pub senpai: Senpai,
    /// The zswap compressor used.
    pub compressor: String,
    /// Host memory used by guest RAM before KSM and the controller started, bytes.
    pub used_before: u64,
    /// With plain twins: Pss of the twins' guest RAM at the same time, bytes (with
    /// [`PeerRun::fpr`], what the managed guests' free page reporting had already given
    /// back shows as `used_before` under this).
    pub plain_used_before: Option<u64>,
    /// Mean over the last 10 s of `used_before − used`, bytes.
    pub saved_bytes: f64,
    /// Seconds until the saving first reached 95% of its plateau.
    pub t95_s: Option<f64>,
    /// CPU seconds of ksmd, kswapd and the controller (whose limit writes reclaim and
    /// compress in its own thread).
    pub cpu_s: f64,
    /// Memory stall over the run, % of time some task stalled (host-wide).
    pub stall_pct: f64,
    /// Guest self-check mismatches (plain twins included).
    pub mismatches: usize,
    /// Whether the managed guests had free page reporting (each checked to report).
    pub fpr: bool,
    /// With plain twins: each workload's throughput, kit-managed vs its plain twin.
    pub throughput: Vec<Throughput>,
    /// Samples, one a second.
    pub samples: Vec<PeerSample>,
}

/// Stops the controller and lifts the group's limit when dropped.
struct Lift {
    stop: Arc<AtomicBool>,
    group: Arc<MemCgroup>,
}

impl Drop for Lift {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.group.unlimit();
    }
}

/// Host memory pressure measured from a mark: the fraction of the time since then that
/// some task stalled on memory (PSI `some`).
struct Stall {
    at: Instant,
    total_us: u64,
}

impl Stall {
    /// A mark now.
    ///
    /// Errors: no memory PSI.
    fn mark() -> Result<Stall> {
        Ok(Stall {
            at: Instant::now(),
            total_us: reclaim::memory_stall_us()?,
        })
    }

    /// The fraction stalled since the mark; the mark moves to now.
    ///
    /// Errors: no memory PSI.
    fn lap(&mut self) -> Result<f64> {
        let now = Stall::mark()?;
        let fraction = now.total_us.saturating_sub(self.total_us) as f64
            / now.at.duration_since(self.at).as_micros().max(1) as f64;
        *self = now;
        Ok(fraction)
    }
}

/// CPU seconds of ksmd and every kswapd.
fn kernel_cpu() -> f64 {
    kernel_threads_cpu_seconds(&["ksmd", "kswapd"])
}

/// Host memory the guests use now by the peer's measure: Pss of guest RAM, bytes.
fn guests_pss(guests: &[Guest]) -> Result<u64> {
    Ok(ram_usages(guests)?.iter().map(|u| u.pss).sum())
}

/// The controller's pace: what `memfold compare` sets of [`Senpai`].
#[derive(Clone, Copy, Debug)]
pub struct Pace {
    /// Pressure to hold, fraction.
    pub target: f64,
    /// Most the limit drops in one interval, fraction of usage.
    pub max_probe: f64,
    /// Seconds between steps.
    pub interval_s: f64,
}

/// The kit `memfold compare` runs: the controller's pace, zswap's compressor, free page
/// reporting, plain twins.
#[derive(Clone, Debug)]
pub struct Kit {
    /// The controller's pace.
    pub pace: Pace,
    /// zswap's compressor (`None`: the first of [`COMPRESSORS`] the kernel takes).
    pub compressor: Option<String>,
    /// Free page reporting in the managed guests (a virtio balloon each).
    pub fpr: bool,
    /// Plain twins beside the managed guests.
    pub twins: Option<Twins>,
}

/// Fails unless every guest of `guests` reported on its console a virtio balloon bound to
/// the `virtio_balloon` driver with free page reporting negotiated.
///
/// Errors: a guest that reported no balloon, another driver or no reporting.
pub fn check_reporting(guests: &[Guest]) -> Result<()> {
    for g in guests {
        let b = g.balloon();
        anyhow::ensure!(
            b.as_ref()
                .is_some_and(|b| b.driver == "virtio_balloon" && b.reporting),
            "guest {}: free page reporting is not on (its console says {:?}; a balloon bound to virtio_balloon with reporting=1 was expected): an image built before virtio_balloon was in the initramfs? `memfold image build` rebuilds stale images",
            g.name,
            b
        );
    }
    Ok(())
}

/// Boots `set` in a memory cgroup of its own with zswap and a swap file on (with
/// [`Kit::fpr`] a balloon with free page reporting in each guest; with [`Kit::twins`] a
/// plain twin beside each, outside all of it), then runs KSM (aggressive) and the Senpai
/// controller at the kit's pace for `secs`, sampling every second. Everything is put back
/// afterwards (zswap's settings, KSM's, the swap file, the group).
///
/// Errors: a piece of the kit is missing (zswap, cgroup v1 memory, PSI, mkswap), a guest
/// does not report free pages when asked to, a guest fails, or the sampling fails.
pub fn run_ksm_zswap(set: &GuestSetArgs, ram: RamBackend, kit: &Kit, secs: u64) -> Result<PeerRun> {
    let (pace, compressor) = (kit.pace, kit.compressor.as_deref());
    let out = set.out_dir("compare");
    std::fs::create_dir_all(&out)?;
    // Offered best ratio first unless one is named.
    let offered: Vec<&str> = compressor.map_or(COMPRESSORS.to_vec(), |c| vec![c]);
    let (zswap, compressor) = Zswap::enable_first(&offered, 25)?;
    let group = Arc::new(MemCgroup::create(&format!(
        "memfold-peer-{}",
        std::process::id()
    ))?);
    // Made before the guests, so that it is switched off after they are gone, whatever
    // ends the run (locals drop in reverse order).
    let ram_bytes: u64 = guests::specs(&set.profiles, ram, set.mem_mib)?
        .iter()
        .map(|s| (s.mem_mib as u64) << 20)
        .sum();
    let swap_path = out.join("peer.swap");
    let _ = std::fs::remove_file(&swap_path);
    let swap = SwapFile::create(&swap_path, ram_bytes)?;
    let procs = group.procs_file();
    let (mut gs, mut plain, _) = guests::start_pairs(
        set,
        kit.twins,
        ram,
        "compare",
        |s, managed| {
            if managed {
                s.cgroup_procs = Some(procs.clone());
                s.free_page_reporting = kit.fpr;
            } else {
                s.mem_merge = false;
            }
        },
        |_| Vec::new(),
    )?;
    if kit.fpr {
        check_reporting(&gs)?;
    }
    let ksm = Ksm::take_control()?;
    ksm.unmerge()?;
    let used_before = guests_pss(&gs)? + reclaim::zswap_pool()?.0;
    let plain_pss = |plain: &[Guest]| -> Result<Option<u64>> {
        Ok(if plain.is_empty() {
            None
        } else {
            Some(guests_pss(plain)?)
        })
    };
    let plain_used_before = plain_pss(&plain)?;
    let usage0 = group.usage()?;
    let senpai = Senpai {
        target: pace.target,
        max_probe: pace.max_probe,
        max_backoff: 0.5,
        interval_s: pace.interval_s,
        // Never squeeze the guests under a tenth of their RAM.
        min_limit: ram_bytes / 10,
    };
    let mut whole_run = Stall::mark()?;
    let since = start_marks(gs.iter().chain(&plain));
    let cpu0 = kernel_cpu();
    ksm.start(KsmMode::AGGRESSIVE)?;
    let stop = Arc::new(AtomicBool::new(false));
    // Dropped first on any early return: the controller stops and the limit is lifted
    // before the guests go and the swap file is switched off.
    let _lift = Lift {
        stop: stop.clone(),
        group: group.clone(),
    };
    let controller = {
        let stop = stop.clone();
        let g = group.clone();
        std::thread::Builder::new()
            .name("memfold-senpai".into())
            .spawn(move || -> Result<f64> {
                // Starts at what the group uses: the first steps reclaim at once.
                let mut limit = usage0;
                let mut interval = Stall::mark()?;
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_secs_f64(senpai.interval_s));
                    let pressure = interval.lap()?;
                    let next = senpai.next(limit, g.usage()?, pressure);
                    if g.set_limit(next)? {
                        limit = next;
                    } else {
                        limit = g.limit()?;
                    }
                }
                // Its own CPU, read before it ends (its /proc entry goes with it).
                Ok(cpu_seconds(std::process::id(), Some("memfold-senpai")))
            })?
    };
    let mut samples = Vec::new();
    let mut second = Stall::mark()?;
    let sampled = every_second(Some(secs), None, |start| {
        for g in gs.iter_mut().chain(plain.iter_mut()) {
            g.check_alive()?;
        }
        let (pool, zswapped) = reclaim::zswap_pool()?;
        let pss = guests_pss(&gs)?;
        let pressure = second.lap()?;
        let s = PeerSample {
            t: start.elapsed().as_secs_f64(),
            used_bytes: pss + pool,
            pss_bytes: pss,
            zswap_pool_bytes: pool,
            zswapped_bytes: zswapped,
            swapped_bytes: group.swapped()?,
            usage_bytes: group.usage()?,
            limit_bytes: group.limit()?,
            pressure,
            pages_sharing: ksm.stats()?.pages_sharing,
            plain_pss_bytes: plain_pss(&plain)?,
        };
        eprint!(
            "\r  ksm+zswap {:>5.0} s  used {:>7.1} MiB (pss {:>6.1}, zswap pool {:>6.1})  limit {:>7.1} MiB  pressure {:>5.2}%   ",
            s.t,
            s.used_bytes as f64 / crate::run::measure::MIB,
            pss as f64 / crate::run::measure::MIB,
            pool as f64 / crate::run::measure::MIB,
            s.limit_bytes as f64 / crate::run::measure::MIB,
            pressure * 100.0
        );
        samples.push(s);
        Ok(())
    });
    eprintln!();
    stop.store(true, Ordering::Relaxed);
    let controller_cpu = controller
        .join()
        .map_err(|_| anyhow::anyhow!("the reclaim controller panicked"))??;
    sampled?;
    let stall_pct = whole_run.lap()? * 100.0;
    let cpu_s = kernel_cpu() - cpu0 + controller_cpu;
    let mismatches = gs.iter().chain(&plain).map(|g| g.mismatches().len()).sum();
    let throughput = throughput(&gs, &plain, &since);
    // Unlimited before anything is undone: unmerging or swapping back in under the
    // squeezed limit could fail or wake the OOM killer.
    group.unlimit()?;
    for g in gs.iter_mut().chain(plain.iter_mut()) {
        g.stop();
    }
    drop(gs);
    drop(plain);
    ksm.unmerge()?;
    drop(ksm);
    drop(swap);
    drop(group);
    drop(zswap);
    let (saved_bytes, t95_s) = plateau(used_before, samples.iter().map(|s| (s.t, s.used_bytes)));
    Ok(PeerRun {
        senpai,
        compressor,
        used_before,
        plain_used_before,
        saved_bytes,
        t95_s,
        cpu_s,
        stall_pct,
        mismatches,
        fpr: kit.fpr,
        throughput,
        samples,
    })
}

/// Writes the peer's samples as CSV.
///
/// Errors: the file cannot be written.
pub fn write_csv(path: &std::path::Path, p: &PeerRun) -> Result<()> {
    use std::io::Write;
    let mut f = crate::create_output(path)?;
    writeln!(f, "t_s,used_bytes,saved_bytes,pss_bytes,zswap_pool_bytes,zswapped_bytes,swapped_bytes,usage_bytes,limit_bytes,pressure_pct,pages_sharing,plain_pss_bytes")?;
    for s in &p.samples {
        writeln!(
            f,
            "{:.1},{},{},{},{},{},{},{},{},{:.3},{},{}",
            s.t,
            s.used_bytes,
            p.used_before as i64 - s.used_bytes as i64,
            s.pss_bytes,
            s.zswap_pool_bytes,
            s.zswapped_bytes,
            s.swapped_bytes,
            s.usage_bytes,
            s.limit_bytes,
            s.pressure * 100.0,
            s.pages_sharing,
            s.plain_pss_bytes.map_or(String::new(), |b| b.to_string())
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Senpai = Senpai {
        target: 0.001,
        max_probe: 0.02,
        max_backoff: 0.5,
        interval_s: 2.0,
        min_limit: 100,
    };

    #[test]
    fn the_limit_probes_down_under_the_target_and_backs_off_over_it() {
        // No pressure: the full probe off the usage.
        assert_eq!(S.next(10_000, 10_000, 0.0), 9_800);
        // Half the target: half the probe.
        assert_eq!(S.next(10_000, 10_000, 0.0005), 9_900);
        // A limit above usage (it never reached it): probed from usage.
        assert_eq!(S.next(50_000, 10_000, 0.0), 9_800);
        // Twice the target: the limit rises by the most it may.
        assert_eq!(S.next(10_000, 10_000, 0.002), 15_000);
        // 1.2× the target: a fifth of the most.
        assert_eq!(S.next(10_000, 10_000, 0.0012), 11_000);
        // Never under the floor.
        assert_eq!(S.next(101, 101, 0.0), 100);
    }
}
