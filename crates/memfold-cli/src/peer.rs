//! The kernel's whole kit as `memfold compare`'s peer (issue 15, `--peer ksm+zswap`): KSM
//! (aggressive) for sharing, zswap for compressing what reclaim pushes out, a swap file
//! behind it, and a proactive-reclaim controller in the manner of Meta's Senpai (TMO,
//! ASPLOS 2022): the guests' QEMUs live in a memory cgroup from birth (v1 or v2, whichever
//! the host mounts), and every interval (2 s by default) the controller reclaims from it
//! while memory pressure stays under a target and backs off when it goes over — on v1 by
//! lowering and raising the group's limit with the group's OOM killer off, on v2 by
//! `memory.reclaim` with no `memory.max` — never under its floors, and a watch raises a v1
//! limit at once when a guest's task waits for memory ([`controller`]). With
//! `--peer ksm+zswap+fpr` each guest also has a virtio balloon with free page reporting:
//! its kernel reports free 2 MiB blocks and QEMU discards them from guest RAM.
//!
//! With plain twins ([`Kit::twins`]) each managed guest has an unmanaged twin beside it:
//! outside the cgroup, its RAM not mergeable (QEMU's `mem-merge=off`), no balloon; the
//! pairs' throughputs are compared as `memfold run --plain-twins` compares them.
//!
//! Host memory the peer leaves is measured like memfold's and KSM's: the Pss of guest RAM
//! (KSM-merged pages split among their mappers; pages swapped out count nothing there)
//! plus guest RAM's share of the zswap pool's own bytes (the compressed pages, not the
//! 4 KiB they stand for; [`peer_used`]). Pages zswap sent on to the swap file left host
//! memory.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use memfold_sys::ksm::{Ksm, KsmMode};
use memfold_sys::reclaim::{self, CgroupVersion, MemCgroup, SwapFile, SwapSpace, Zswap};
use memfold_vm::launcher::{Guest, RamBackend};

use crate::run::measure::{start_marks, throughput, Throughput};
use crate::run::Twins;
use serde::Serialize;

use crate::guests::{self, GuestSetArgs};

pub mod controller;
use crate::run::cpu_seconds;
use crate::run::measure::{
    every_second, kernel_threads_cpu_seconds, plateau, ram_usages, zswap_share,
};
pub use controller::{Controller, ControllerBook, Reading, Senpai};

/// Compressors zswap is offered, best ratio first: the first the kernel takes is used.
pub const COMPRESSORS: [&str; 5] = ["zstd", "deflate", "lz4", "lzo-rle", "lzo"];

/// One sample of the peer.
#[derive(Clone, Debug, Serialize)]
pub struct PeerSample {
    /// Seconds since KSM and the controller started.
    pub t: f64,
    /// Host memory the guests' RAM takes: `pss_bytes` + guest RAM's share of
    /// `zswap_pool_bytes` ([`peer_used`]), and KSM's own (`own_bytes`).
    pub used_bytes: u64,
    /// Of `used_bytes`, KSM's own memory in the kernel, bytes (its rmap items,
    /// `KsmStats::rmap_bytes`): the kit's cost, counted as memfoldd's is on memfold's side.
    pub own_bytes: u64,
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
    /// The host's free swap, bytes (zswap's pages take swap slots too).
    pub swap_free_bytes: u64,
    /// v1: some task of the group waits for memory now (`under_oom`).
    pub under_oom: bool,
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
    /// Guest self-check mismatches (plain twins included), `guest: line`.
    pub mismatches: Vec<String>,
    /// `vm.page-cluster` (swap readahead) during the run: memfold's zswap backing's
    /// (`memfold_sys::reclaim::SwapReadaheadOff`).
    pub page_cluster: Option<u32>,
    /// Stopped (Ctrl-C, SIGTERM) before its `secs`.
    pub interrupted: bool,
    /// Whether the managed guests had free page reporting (each checked to report).
    pub fpr: bool,
    /// With plain twins: each workload's throughput, kit-managed vs its plain twin.
    pub throughput: Vec<Throughput>,
    /// The group's cgroup hierarchy.
    pub cgroup: CgroupVersion,
    /// v1: the OOM killer was off for the group (`memory.oom_control`); false on v2,
    /// where no `memory.max` is set.
    pub oom_killer_off: bool,
    /// What the controller did, and every OOM sign it saw.
    pub controller: ControllerBook,
    /// OOM kills in the group over the run (the kernel's `oom_kill` counter, end − start).
    pub oom_kills: u64,
    /// v2: `oom` events of memory.events over the run (end − start); `None` on v1.
    pub oom_events: Option<u64>,
    /// Guests whose QEMU ended during the run, with what it said: the run stopped there.
    pub qemu_deaths: Vec<String>,
    /// Samples, one a second.
    pub samples: Vec<PeerSample>,
}

impl PeerRun {
    /// What fails the compare (after its outputs): QEMU deaths (the set measured changed),
    /// self-check mismatches (a guest's memory read wrong), an early stop.
    pub fn failures(&self) -> Vec<String> {
        let mut m = Vec::new();
        if !self.qemu_deaths.is_empty() {
            m.push(format!(
                "{} QEMU death(s): {}",
                self.qemu_deaths.len(),
                self.qemu_deaths.join("; ")
            ));
        }
        m.extend(crate::run::measure::mismatch_failures(&self.mismatches));
        if self.interrupted {
            m.push("interrupted (Ctrl-C or SIGTERM) before its --secs".into());
        }
        m
    }

    /// Why the run is marked, if it is: its [`PeerRun::failures`], OOM kills, OOM events,
    /// episodes in which a guest's task waited for memory, and workloads whose speed was
    /// not measured. Empty: a clean run.
    pub fn marks(&self) -> Vec<String> {
        let mut m = self.failures();
        if self.oom_kills > 0 {
            m.push(format!(
                "{} OOM kill(s) in the peer's cgroup",
                self.oom_kills
            ));
        }
        if let Some(e) = self.oom_events.filter(|&e| e > 0) {
            m.push(format!(
                "{e} OOM event(s) in the peer's cgroup (memory.events)"
            ));
        }
        if self.controller.under_oom_episodes > 0 {
            m.push(format!(
                "{} under_oom episode(s): a guest's task waited for memory until the limit was raised",
                self.controller.under_oom_episodes
            ));
        }
        m.extend(crate::run::measure::unmeasured(&self.throughput));
        m
    }
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

/// Memory pressure measured from a mark: the fraction of the time since then that some
/// task stalled on memory (PSI `some`), host-wide or of one group.
struct Stall {
    at: Instant,
    total_us: u64,
    /// The group whose own PSI is read (v2); `None`: the host's.
    group: Option<Arc<MemCgroup>>,
}

impl Stall {
    /// A mark now, of the host's PSI.
    ///
    /// Errors: no memory PSI.
    fn mark() -> Result<Stall> {
        Stall::mark_of(None)
    }

    /// A mark now, of `group`'s own PSI where it has one (v2), else the host's (v1: the
    /// group keeps none).
    ///
    /// Errors: no memory PSI.
    fn mark_of(group: Option<Arc<MemCgroup>>) -> Result<Stall> {
        let own = match &group {
            Some(g) => g.stall_us()?,
            None => None,
        };
        let total_us = match own {
            Some(us) => us,
            None => reclaim::memory_stall_us()?,
        };
        Ok(Stall {
            at: Instant::now(),
            total_us,
            group,
        })
    }

    /// The fraction stalled since the mark; the mark moves to now.
    ///
    /// Errors: no memory PSI.
    fn lap(&mut self) -> Result<f64> {
        let now = Stall::mark_of(self.group.clone())?;
        let fraction = now.total_us.saturating_sub(self.total_us) as f64
            / now.at.duration_since(self.at).as_micros().max(1) as f64;
        *self = now;
        Ok(fraction)
    }
}

/// The controller's step thread's name (CPU is counted by it).
const STEP_THREAD: &str = "memfold-senpai";
/// The controller's OOM watch thread's name (at most 15 bytes).
const WATCH_THREAD: &str = "memfold-oomwat";

/// The controller's shared state, locked (a panic in the other thread leaves it usable:
/// plain counters and marks).
fn lock<T>(c: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    c.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A step's write in the kernel: since when, by which thread, and whether the watch has
/// interrupted it.
struct Writing {
    since: Instant,
    thread: libc::pthread_t,
    interrupted: bool,
}

/// CPU seconds of ksmd and every kswapd.
fn kernel_cpu() -> f64 {
    kernel_threads_cpu_seconds(&["ksmd", "kswapd"])
}

/// Host memory the guests use now by the peer's measure: Pss of guest RAM, bytes.
fn guests_pss(guests: &[Guest]) -> Result<u64> {
    Ok(ram_usages(guests)?.iter().map(|u| u.pss).sum())
}

/// Host memory guest RAM `ram` uses by the peer's measure, bytes: its Pss plus its share
/// of the zswap pool (`pool` × its swap / `zswapped`, [`zswap_share`]): the pool holds
/// QEMU's own swapped memory too. Its swap is `SwapPss`: a KSM page swapped out is one
/// slot for all its sharers, which `Swap:` counts once per guest mapping it (before
/// 2026-12-03 it did, and the share reached the whole pool in the 600 s runs).
fn peer_used(ram: &[memfold_vm::hostmem::RamUsage], pool: u64, zswapped: u64) -> u64 {
    let pss: u64 = ram.iter().map(|u| u.pss).sum();
    let swap: u64 = ram.iter().map(|u| u.anon_swap_pss).sum();
    pss + zswap_share(pool, zswapped, swap)
}

/// [`peer_used`] of `guests` now, bytes.
fn guests_used(guests: &[Guest]) -> Result<u64> {
    let (pool, zswapped) = reclaim::zswap_pool()?;
    Ok(peer_used(&ram_usages(guests)?, pool, zswapped))
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
    /// The lowest the controller takes the group, fraction of the guests' RAM.
    pub floor: f64,
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
/// controller at the kit's pace for `secs` (or until `user_stop` is set: Ctrl-C), sampling
/// every second, with swap readahead as memfold's zswap backing has it
/// (`memfold_sys::reclaim::SwapReadaheadOff`). Everything is put back afterwards (zswap's
/// settings, KSM's, the swap file, `vm.page-cluster`, the group).
///
/// A guest whose QEMU ends during the sampling stops the run, which returns with it in
/// [`PeerRun::qemu_deaths`] (a marked run, [`PeerRun::marks`]).
///
/// Errors: a piece of the kit is missing (zswap, a memory cgroup controller, PSI, mkswap),
/// a guest does not report free pages when asked to, a guest fails to boot, the controller
/// cannot read or write its group, or the sampling fails.
pub fn run_ksm_zswap(
    set: &GuestSetArgs,
    ram: RamBackend,
    kit: &Kit,
    secs: u64,
    user_stop: &AtomicBool,
) -> Result<PeerRun> {
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
    // Before any guest is in it: a task at the limit waits for the controller's watch to
    // raise it rather than being killed (v1; v2 sets no memory.max).
    let oom_killer_off = group.disable_oom_killer()?;
    let oom0 = group.oom()?;
    // Made before the guests, so that it is switched off after they are gone, whatever
    // ends the run (locals drop in reverse order).
    let ram_bytes: u64 = guests::specs(&set.profiles, ram, set.mem_mib)?
        .iter()
        .map(|s| (s.mem_mib as u64) << 20)
        .sum();
    let swap_path = out.join("peer.swap");
    let _ = std::fs::remove_file(&swap_path);
    let swap = SwapFile::create(&swap_path, ram_bytes)?;
    // As memfold's zswap backing runs: readahead would fill the swap cache with unmapped
    // pages that neither Pss nor the zswap pool counts.
    let readahead = memfold_sys::reclaim::SwapReadaheadOff::new()?;
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
    let used_before = guests_used(&gs)? + ksm.stats()?.rmap_bytes();
    let plain_pss = |plain: &[Guest]| -> Result<Option<u64>> {
        Ok(if plain.is_empty() {
            None
        } else {
            Some(guests_pss(plain)?)
        })
    };
    let plain_used_before = plain_pss(&plain)?;
    let senpai = Senpai {
        target: pace.target,
        max_probe: pace.max_probe,
        max_backoff: 0.5,
        interval_s: pace.interval_s,
        min_limit: (ram_bytes as f64 * pace.floor).round() as u64,
        swap_reserve: 0.1,
        oom_cooldown_steps: 5,
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
    let ctl = Arc::new(Mutex::new(Controller::new(senpai, group.version(), oom0)));
    let every = Duration::from_secs_f64(senpai.interval_s);
    // The step's write in the kernel now, if any: the watch cuts it short.
    let writing: Arc<Mutex<Option<Writing>>> = Arc::new(Mutex::new(None));
    // Set by the stepping thread as it ends: the watch outlives it, to cut short a write
    // still in the kernel when the run stops.
    let steps_done = Arc::new(AtomicBool::new(false));
    reclaim::install_interrupt()?;
    // The watch: every WATCH_SLICE, the group's OOM state, answered at once; and a step's
    // write still in the kernel after an interval (the kernel reclaiming to a v1 limit
    // as long as it makes progress) or when a task waits is interrupted, so that the
    // controller can back off and a rescue is not undone by a lower limit landing after it.
    let watch = {
        let (stop, g, ctl, writing) = (stop.clone(), group.clone(), ctl.clone(), writing.clone());
        let steps_done = steps_done.clone();
        std::thread::Builder::new()
            .name(WATCH_THREAD.into())
            .spawn(move || -> Result<f64> {
                while !steps_done.load(Ordering::SeqCst) {
                    std::thread::sleep(controller::WATCH_SLICE);
                    let stopping = stop.load(Ordering::Relaxed);
                    let r = Reading {
                        usage: g.usage()?,
                        limit: g.limit()?,
                        oom: g.oom()?,
                        ..Reading::default()
                    };
                    let a = lock(&ctl).watch(&r);
                    if let Some(w) = lock(&writing).as_mut() {
                        if stopping || a.is_some() || w.since.elapsed() >= every {
                            // SAFETY: `writing` is Some only between the step thread's
                            // setting it before its write and its clearing it after, under
                            // this lock: the thread is alive and in (or about) its write.
                            unsafe { reclaim::interrupt(w.thread)? };
                            w.interrupted = true;
                        }
                    }
                    if let Some(a) = a {
                        let done = controller::apply(&g, a)?;
                        lock(&ctl).answered(a, done);
                    }
                }
                Ok(cpu_seconds(std::process::id(), Some(WATCH_THREAD)))
            })?
    };
    // The steps: every interval, Senpai's rule within the floors.
    let steps = {
        let (stop, g, ctl) = (stop.clone(), group.clone(), ctl.clone());
        let steps_done = steps_done.clone();
        std::thread::Builder::new()
            .name(STEP_THREAD.into())
            .spawn(move || -> Result<f64> {
                // Whichever way it ends, the watch is told.
                struct Done(Arc<AtomicBool>);
                impl Drop for Done {
                    fn drop(&mut self) {
                        self.0.store(true, Ordering::SeqCst);
                    }
                }
                let _done = Done(steps_done);
                let mut interval = Stall::mark_of(Some(g.clone()))?;
                let every = Duration::from_secs_f64(senpai.interval_s);
                while !stop.load(Ordering::Relaxed) {
                    let t0 = Instant::now();
                    while t0.elapsed() < every && !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(
                            controller::WATCH_SLICE.min(every - t0.elapsed().min(every)),
                        );
                    }
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let r = Reading {
                        usage: g.usage()?,
                        limit: g.limit()?,
                        pressure: interval.lap()?,
                        oom: g.oom()?,
                        swap: SwapSpace::now()?,
                    };
                    let a = lock(&ctl).step(&r);
                    *lock(&writing) = Some(Writing {
                        since: Instant::now(),
                        thread: reclaim::this_thread(),
                        interrupted: false,
                    });
                    let done = controller::apply(&g, a);
                    let interrupted = lock(&writing).take().is_some_and(|w| w.interrupted);
                    let mut c = lock(&ctl);
                    c.answered(a, done?);
                    c.book.interrupted += u64::from(interrupted);
                }
                // Its own CPU, read before it ends (its /proc entry goes with it).
                Ok(cpu_seconds(std::process::id(), Some(STEP_THREAD)))
            })?
    };
    let mut samples = Vec::new();
    let mut second = Stall::mark()?;
    // A QEMU that ends stops the run, which is then marked ([`PeerRun::marks`]).
    let mut qemu_deaths = Vec::new();
    let died = AtomicBool::new(false);
    let (mut page_cluster, mut sampled_s) = (None, 0.0);
    let sampled = every_second(Some(secs), &[&died, user_stop], |start| {
        for g in gs.iter_mut().chain(plain.iter_mut()) {
            if let Err(e) = g.check_alive() {
                qemu_deaths.push(format!("{}: {e}", g.name));
            }
        }
        if !qemu_deaths.is_empty() {
            died.store(true, Ordering::SeqCst);
            return Ok(());
        }
        page_cluster = page_cluster.or_else(memfold_sys::reclaim::page_cluster);
        sampled_s = start.elapsed().as_secs_f64();
        let ram = ram_usages(&gs)?;
        let (pool, zswapped) = reclaim::zswap_pool()?;
        let pss = ram.iter().map(|u| u.pss).sum();
        let pressure = second.lap()?;
        let ksm_now = ksm.stats()?;
        let s = PeerSample {
            t: start.elapsed().as_secs_f64(),
            used_bytes: peer_used(&ram, pool, zswapped) + ksm_now.rmap_bytes(),
            own_bytes: ksm_now.rmap_bytes(),
            pss_bytes: pss,
            zswap_pool_bytes: pool,
            zswapped_bytes: zswapped,
            swapped_bytes: group.swapped()?,
            usage_bytes: group.usage()?,
            limit_bytes: group.limit()?,
            pressure,
            pages_sharing: ksm_now.pages_sharing,
            swap_free_bytes: SwapSpace::now()?.free,
            under_oom: group.oom()?.under_oom,
            plain_pss_bytes: plain_pss(&plain)?,
        };
        eprint!(
            "\r  ksm+zswap {:>5.0} s  used {:>7.1} MiB (pss {:>6.1}, zswap pool {:>6.1})  usage {:>7.1} MiB, limit {:>7}  pressure {:>5.2}%{}   ",
            s.t,
            s.used_bytes as f64 / crate::run::measure::MIB,
            pss as f64 / crate::run::measure::MIB,
            pool as f64 / crate::run::measure::MIB,
            s.usage_bytes as f64 / crate::run::measure::MIB,
            if s.limit_bytes >= 1 << 62 {
                "none".to_string()
            } else {
                format!("{:.1} MiB", s.limit_bytes as f64 / crate::run::measure::MIB)
            },
            pressure * 100.0,
            if s.under_oom { "  UNDER OOM" } else { "" }
        );
        samples.push(s);
        Ok(())
    });
    eprintln!();
    stop.store(true, Ordering::Relaxed);
    // The stepping thread ends first (the watch cuts short its write in the kernel, if
    // any, and ends after it).
    let steps_cpu = steps
        .join()
        .map_err(|_| anyhow::anyhow!("the reclaim controller panicked"))?;
    let controller_cpu = watch
        .join()
        .map_err(|_| anyhow::anyhow!("the reclaim controller's OOM watch panicked"))??
        + steps_cpu?;
    sampled?;
    let oom1 = group.oom()?;
    let book = lock(&ctl).book;
    let stall_pct = whole_run.lap()? * 100.0;
    let cpu_s = kernel_cpu() - cpu0 + controller_cpu;
    let mismatches = crate::run::mismatches(gs.iter().chain(&plain));
    let interrupted = sampled_s < secs as f64 && user_stop.load(Ordering::SeqCst);
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
    drop(readahead);
    let group_version = group.version();
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
        page_cluster,
        interrupted,
        fpr: kit.fpr,
        throughput,
        cgroup: group_version,
        oom_killer_off,
        controller: book,
        oom_kills: oom1.oom_kills.saturating_sub(oom0.oom_kills),
        oom_events: oom1.ooms.map(|e| e.saturating_sub(oom0.ooms.unwrap_or(0))),
        qemu_deaths,
        samples,
    })
}

/// Writes the peer's samples as CSV.
///
/// Errors: the file cannot be written.
pub fn write_csv(path: &std::path::Path, p: &PeerRun) -> Result<()> {
    use std::io::Write;
    let mut f = crate::create_output(path)?;
    writeln!(f, "t_s,used_bytes,saved_bytes,own_bytes,pss_bytes,zswap_pool_bytes,zswapped_bytes,swapped_bytes,usage_bytes,limit_bytes,pressure_pct,pages_sharing,swap_free_bytes,under_oom,plain_pss_bytes")?;
    for s in &p.samples {
        writeln!(
            f,
            "{:.1},{},{},{},{},{},{},{},{},{},{:.3},{},{},{},{}",
            s.t,
            s.used_bytes,
            p.used_before as i64 - s.used_bytes as i64,
            s.own_bytes,
            s.pss_bytes,
            s.zswap_pool_bytes,
            s.zswapped_bytes,
            s.swapped_bytes,
            s.usage_bytes,
            s.limit_bytes,
            s.pressure * 100.0,
            s.pages_sharing,
            s.swap_free_bytes,
            u8::from(s.under_oom),
            s.plain_pss_bytes.map_or(String::new(), |b| b.to_string())
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run() -> PeerRun {
        PeerRun {
            senpai: Senpai {
                target: 0.001,
                max_probe: 0.02,
                max_backoff: 0.5,
                interval_s: 2.0,
                min_limit: 0,
                swap_reserve: 0.1,
                oom_cooldown_steps: 5,
            },
            compressor: "deflate".into(),
            used_before: 0,
            plain_used_before: None,
            saved_bytes: 0.0,
            t95_s: None,
            cpu_s: 0.0,
            stall_pct: 0.0,
            mismatches: Vec::new(),
            page_cluster: Some(0),
            interrupted: false,
            fpr: false,
            throughput: Vec::new(),
            cgroup: CgroupVersion::V1,
            oom_killer_off: true,
            controller: ControllerBook::default(),
            oom_kills: 0,
            oom_events: None,
            qemu_deaths: Vec::new(),
            samples: Vec::new(),
        }
    }

    #[test]
    fn only_guest_ram_s_share_of_the_zswap_pool_counts() {
        const MIB: u64 = 1 << 20;
        let ram = [memfold_vm::hostmem::RamUsage {
            pss: 100 * MIB,
            swap: 300 * MIB,
            anon_swap_pss: 300 * MIB,
            ..Default::default()
        }];
        assert_eq!(peer_used(&ram, 130 * MIB, 390 * MIB), 200 * MIB);
        // Pages written on to the swap file: never more than the pool.
        assert_eq!(peer_used(&ram, 130 * MIB, 100 * MIB), 230 * MIB);
        // Two guests sharing 150 MiB of KSM pages, swapped out: 150 MiB of slots, which
        // each guest's `Swap:` shows whole.
        let sharer = memfold_vm::hostmem::RamUsage {
            pss: 50 * MIB,
            swap: 150 * MIB,
            anon_swap_pss: 75 * MIB,
            ..Default::default()
        };
        assert_eq!(
            peer_used(&[sharer.clone(), sharer], 130 * MIB, 390 * MIB),
            150 * MIB
        );
    }

    #[test]
    fn a_run_with_any_oom_sign_or_death_is_marked() {
        assert!(run().marks().is_empty());
        assert!(PeerRun {
            oom_events: Some(0),
            ..run()
        }
        .marks()
        .is_empty());
        let mut r = run();
        r.qemu_deaths.push("db-1: exited".into());
        r.oom_kills = 1;
        r.oom_events = Some(2);
        r.controller.under_oom_episodes = 3;
        let m = r.marks();
        assert_eq!(m.len(), 4, "{m:?}");
        assert!(m[0].contains("db-1") && m[1].starts_with("1 OOM kill"));
        assert!(m[2].starts_with("2 OOM event") && m[3].starts_with("3 under_oom"));
        assert_eq!(
            r.failures().len(),
            1,
            "a death fails the compare; OOM signs mark it"
        );
    }

    /// A guest's self-check mismatch, an early stop or an unmeasured workload marks the
    /// kit's run (`tradeoff` never picks it); the first two fail the compare too.
    #[test]
    fn a_mismatch_or_an_early_stop_marks_the_run_and_fails_it() {
        let mut r = run();
        r.mismatches
            .push("web-1-plain: MEMFOLD-MISMATCH page 9".into());
        r.interrupted = true;
        let f = r.failures();
        assert_eq!(f.len(), 2, "{f:?}");
        assert!(f[0].contains("MEMFOLD-MISMATCH page 9") && f[1].starts_with("interrupted"));
        assert_eq!(r.marks(), f);
        let mut t = run();
        t.throughput.push(Throughput {
            guest: "db-1".into(),
            twin: "db-1-plain".into(),
            metric: "pgbench-tps".into(),
            managed: 0.0,
            managed_rounds: 0,
            plain: 40.0,
            plain_rounds: 9,
            ratio: 0.0,
            managed_cpu_s: 0.0,
            managed_agent_cpu_s: 0.0,
            plain_cpu_s: 0.0,
            change_2se: None,
        });
        assert!(t.failures().is_empty());
        assert!(
            t.marks()[0].contains("no rounds on the managed guest"),
            "{:?}",
            t.marks()
        );
    }
}
