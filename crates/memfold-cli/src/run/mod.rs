//! `memfold run`: the main job. Boots a guest set with memfold's agent in each QEMU, starts
//! memfoldd (the Difference Engine policy unless `--policy` says otherwise), and shows
//! live per guest and in total what it saves, by mechanism, measured with the
//! one host-memory definition (`memfold_vm::hostmem`) that `memfold ksm` uses too.
//!
//! This module is the orchestration (guests up, memfoldd up, sample each second, all
//! down); [`args`] has the flags and memfoldd's command line, [`measure`](mod@measure) what is
//! measured, [`view`] the live view, [`output`] the files and the summary.

mod args;
pub mod measure;
mod output;
mod view;

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use memfold_core::ClaimPolicy;
use memfold_vm::launcher::{agent_env, Guest, RamBackend};

pub use args::{MemfoldArgs, RunArgs, Twins};
pub use measure::cpu_seconds;
use measure::{MemfoldRun, Sample, MIB};
pub(crate) use output::mechanisms_mib;
pub use output::{print_throughput, write_outputs};

use crate::guests;

/// Guest RAM under memfold: memfd files memfoldd reads and the agent maps.
const RAM: RamBackend = RamBackend::Memfd;

/// The agent library (beside the `memfold` binary or in `../lib/memfold`,
/// [`memfold_cli::install`]) and memfoldd (beside it); and the privileges a run needs,
/// checked before any guest boots.
pub(crate) fn companions() -> Result<(PathBuf, PathBuf)> {
    anyhow::ensure!(
        rustix::process::geteuid().is_root(),
        "memfold run and compare need root: the agent in each QEMU opens a userfaultfd for kernel faults (CAP_SYS_PTRACE), and compare drives KSM's sysfs; run them with sudo"
    );
    // The agent's userfaultfd, with every feature it asks for, before any guest boots.
    use memfold_sys::uffd;
    uffd::Uffd::open(uffd::AGENT_FEATURES)
    .context("memfold's agent needs a userfaultfd for shmem missing, write-protect and minor faults (Linux 6.1 or later, CONFIG_USERFAULTFD, CONFIG_PTE_MARKER_UFFD_WP)")?;
    let exe = std::env::current_exe().context("cannot find the memfold binary")?;
    let agent = memfold_cli::install::agent_library(&exe).ok_or_else(|| {
        let tried: Vec<String> = memfold_cli::install::agent_library_candidates(&exe)
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        anyhow::anyhow!(
            "the agent library is missing (tried {}): build the whole workspace (`cargo build --release --workspace`; make main does) or install it (README, Install)",
            tried.join(", ")
        )
    })?;
    let daemon = exe.with_file_name("memfoldd");
    anyhow::ensure!(
        daemon.exists(),
        "{} is missing: build the whole workspace (`cargo build --release --workspace`; make main does)",
        daemon.display()
    );
    Ok((agent, daemon))
}

/// How long after memfoldd starts every managed guest's agent must have attached, s (the
/// agents retry every second; QEMU has mapped guest RAM long before).
const ATTACH_WAIT_S: f64 = 30.0;

/// Names of the guests `stats` lists as attached.
fn attached_names(stats: &memfold_wire::Stats) -> impl Iterator<Item = String> + '_ {
    stats
        .vms
        .iter()
        .filter(|v| !v.detached)
        .map(|v| v.name.clone())
}

/// The managed guests never seen attached (`seen`: every name any memfoldd of the run
/// listed as attached, so a restart's gap does not count) and not paused by their agent
/// failing closed.
fn unattached<'a>(
    managed: impl Iterator<Item = &'a str>,
    seen: &std::collections::BTreeSet<String>,
    paused: &[String],
) -> Vec<String> {
    managed
        .filter(|n| !paused.iter().any(|p| p == n))
        .filter(|n| !seen.contains(*n))
        .map(String::from)
        .collect()
}

/// Restarts of memfoldd a run makes before it gives up (and ends non-zero).
const MAX_DAEMON_RESTARTS: u32 = 3;

/// Kills memfoldd when dropped.
pub(crate) struct Daemon(pub(crate) Child);

impl Daemon {
    /// Fails if memfoldd has exited: a bench that went on without it would report the
    /// agents and devices alone as memfold's numbers (a `disk-io` run with `--clock-secs
    /// 0` did so: memfoldd refuses policy `de` without a clock and exits at once). `log`
    /// is its stderr, whose last line the error quotes.
    pub(crate) fn ensure_alive(&mut self, log: &std::path::Path) -> Result<()> {
        match self.0.try_wait()? {
            None => Ok(()),
            Some(status) => {
                let last = std::fs::read_to_string(log).unwrap_or_default();
                let last = last
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("");
                anyhow::bail!(
                    "memfoldd exited ({status}) during the run, so its numbers are not memfold's: {last} (log: {})",
                    log.display()
                )
            }
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The self-check failures of `guests` ([`Guest::mismatches`]: mismatches reported, and a
/// self-check that stalled), `guest: line` each.
pub(crate) fn mismatches<'a>(guests: impl Iterator<Item = &'a Guest>) -> Vec<String> {
    guests
        .flat_map(|g| {
            g.mismatches()
                .into_iter()
                .map(|l| format!("{}: {l}", g.name))
        })
        .collect()
}

/// Fails with `failures` (a side's marks that fail the command: [`MemfoldRun::failures`]
/// and the peers'), each printed; `what` names the side and `out` where its outputs were
/// written. Called after those outputs are written, so that they can be read.
pub(crate) fn ensure_clean(what: &str, failures: &[String], out: &std::path::Path) -> Result<()> {
    if failures.is_empty() {
        return Ok(());
    }
    for f in failures {
        eprintln!("!! {what}: {f}");
    }
    anyhow::bail!(
        "{what}: {} ({} in all); the outputs in {} have the figures, marked",
        failures[0],
        failures.len(),
        out.display()
    )
}

/// The host set up for `--compress-backing zswap` ([`kernel_swap`]): each part undone
/// when it drops.
struct KernelSwap {
    /// zswap on, with `compressor`.
    _zswap: memfold_sys::reclaim::Zswap,
    /// The swap file, the size of the guests' RAM.
    _swap: memfold_sys::reclaim::SwapFile,
    /// `vm.page-cluster` for the run, as the kit's.
    _readahead: memfold_sys::reclaim::SwapReadaheadOff,
    /// The compressor zswap took.
    compressor: String,
}

/// For `--compress-backing zswap`: zswap on with `--backing-compressor` or the best
/// compressor the kernel takes (`peer::COMPRESSORS`, as the peer's), a swap file the size
/// of the guests' RAM, and swap readahead off as the kit's (`SwapReadaheadOff`), all
/// undone when the guard drops; `None` for the store backing.
///
/// Errors: no zswap, no compressor taken, the swap file cannot be made (not root, disk);
/// `--backing-compressor` with the store backing.
fn kernel_swap(m: &args::MemfoldArgs, out: &std::path::Path) -> Result<Option<KernelSwap>> {
    if m.engine.compress_backing != memfold_core::engine::CompressBacking::Zswap {
        anyhow::ensure!(
            m.backing_compressor.is_none(),
            "--backing-compressor names zswap's compressor for --compress-backing zswap; the backing here is {}",
            m.engine.compress_backing
        );
        return Ok(None);
    }
    let offered: Vec<&str> = m
        .backing_compressor
        .as_deref()
        .map_or(crate::peer::COMPRESSORS.to_vec(), |c| vec![c]);
    let (zswap, compressor) = memfold_sys::reclaim::Zswap::enable_first(&offered, 25)
        .context("--compress-backing zswap")?;
    let ram_bytes: u64 = guests::specs(&m.set.profiles, RAM, m.set.mem_mib)?
        .iter()
        .map(|s| (s.mem_mib as u64) << 20)
        .sum();
    let path = out.join("memfold-kernel.swap");
    let _ = std::fs::remove_file(&path);
    let swap = memfold_sys::reclaim::SwapFile::create(&path, ram_bytes)
        .context("--compress-backing zswap: the swap file")?;
    let readahead = memfold_sys::reclaim::SwapReadaheadOff::new()
        .context("--compress-backing zswap: vm.page-cluster")?;
    eprintln!(
        "(compress backing: the kernel's swap; zswap on with {compressor}, a swap file of {} MiB at {}, swap readahead off for the run)",
        ram_bytes >> 20,
        path.display()
    );
    Ok(Some(KernelSwap {
        _zswap: zswap,
        _swap: swap,
        _readahead: readahead,
        compressor: compressor.to_string(),
    }))
}

/// Boots the set with agents, waits for it to settle, starts memfoldd and samples every
/// second for `secs` (0: until `stop`), printing the live view.
pub fn measure(a: &RunArgs, default_out: &str, stop: &AtomicBool) -> Result<(MemfoldRun, PathBuf)> {
    let (agent, daemon_bin) = companions()?;
    let m = &a.memfold;
    let out = m.set.out_dir(default_out);
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let socket = std::fs::canonicalize(&out)?.join("memfoldd.sock");
    let data_disk = m.data_disk(&out)?;
    let channels = args::channels_dir(&socket);
    if m.enlightened {
        std::fs::create_dir_all(&channels)
            .with_context(|| format!("cannot create {}", channels.display()))?;
    }
    let names: Vec<String> = guests::specs(&m.set.profiles, RAM, m.set.mem_mib)?
        .into_iter()
        .map(|s| s.name)
        .collect();
    for g in m.named_guests() {
        anyhow::ensure!(
            names.iter().any(|n| n == g),
            "guest {g} (--break-sharing, --drop-caches): no such guest (the guests are {})",
            names.join(", ")
        );
    }
    // The zswap backing's kernel half, made before the guests so that it goes after them
    // (locals drop in reverse order): zswap on, a swap file for every guest's RAM.
    // Held to the end of the run: dropped, it puts the host back.
    let kernel_swap = kernel_swap(m, &out)?;
    let backing_compressor = kernel_swap.as_ref().map(|k| k.compressor.clone());
    let (mut guests, mut plain, out) = guests::start_pairs(
        &m.set,
        a.twins(),
        RAM,
        default_out,
        |s, managed| {
            s.free_page_reporting = managed && m.free_page_reporting;
            s.memfold_balloon = managed && m.engine.claim() != ClaimPolicy::Never;
            s.data_disk.clone_from(&data_disk);
            s.kernel_args = m.kernel_args_of(&s.name);
            s.memfold_blk = m
                .blk_disks(&s.profile, data_disk.is_some(), managed.then_some(&*socket))
                .expect("the profiles were checked above");
            if managed && m.enlightened {
                s.guest_channel = Some(channels.join(format!("{}.sock", s.name)));
            }
        },
        |s| {
            let mut env = agent_env(&agent, &socket, s);
            env.push((
                "MEMFOLD_CLOCK_RBITS".into(),
                m.clock_rbits.env_value().into(),
            ));
            env
        },
    )?;
    if m.free_page_reporting {
        crate::peer::check_reporting(&guests)?;
    }
    let since = measure::start_marks(guests.iter().chain(&plain));
    let blk_pids = |gs: &[Guest]| -> Vec<u32> {
        gs.iter()
            .flat_map(|g| g.blk_processes())
            .filter_map(|(_, pid, _)| pid)
            .collect()
    };
    // memfold-blk does memfold's read reporting and fills: its CPU is memfold's.
    let mut blk_cpu = measure::ProcCpu::starting(blk_pids(&guests));
    let used_before = measure::used(&guests)?.0;
    let log_path = out.join("memfoldd.log");
    let start_daemon = || -> Result<Daemon> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        Ok(Daemon(
            Command::new(&daemon_bin)
                .args(m.memfoldd_args(&socket, &out))
                .args(
                    a.metrics_listen
                        .iter()
                        .flat_map(|l| ["--metrics-listen".to_string(), l.to_string()]),
                )
                .stderr(log)
                .spawn()
                .with_context(|| format!("cannot start {}", daemon_bin.display()))?,
        ))
    };
    let mut daemon = start_daemon()?;
    let agent_cpu0: f64 = guests.iter().map(|g| since[&g.name].2).sum();
    let mut samples: Vec<Sample> = Vec::new();
    eprintln!(
        "memfoldd at {} (`memfold top --socket {0}` shows it full screen)",
        socket.display()
    );
    eprintln!(
        "memfoldd running (pid {}); host memory used by guest RAM before: {:.1} MiB. Ctrl-C stops.",
        daemon.0.id(),
        used_before as f64 / MIB
    );
    // memfoldd is supervised: if it dies, the run says so, restarts it (the agents serve
    // their guests meanwhile and re-attach), marks the gap, and measures on.
    let (mut restarts, mut cpu_dead, mut cpu_last) = (0u32, 0.0, 0.0);
    let (mut kills, mut killed_at) = (0u32, 0.0);
    // A managed QEMU found stopped was paused by its agent failing closed: said once, shown
    // in the view and the summary; the run goes on (the paused QEMU is kept for `gcore`,
    // the others measured to the end) and fails after its outputs are written.
    let mut announced: Vec<String> = Vec::new();
    let mut attach_checked = false;
    let mut seen = std::collections::BTreeSet::new();
    let mut censuses = crate::census::CensusEvery::new(m.census);
    // Memory stall over the sampled window only: boots, attaches and the shutdown after it
    // are not the run's steady state, and the kit's side is measured over its window too.
    let stall0 = (
        memfold_sys::reclaim::memory_stall_us().ok(),
        std::time::Instant::now(),
    );
    // Set at a self-check mismatch (a guest's memory read wrong) or stall (no longer
    // verified), so the sampling ends there (the outputs are still written, then the command fails).
    let mismatched = AtomicBool::new(false);
    let mut page_cluster = None;
    let mut sampled_s = 0.0;
    let stops = [stop, &mismatched];
    measure::every_second((m.secs > 0).then_some(m.secs), &stops, |start| {
        for g in guests.iter_mut().chain(plain.iter_mut()) {
            g.check_alive()?;
        }
        if !mismatches(guests.iter().chain(&plain)).is_empty() {
            mismatched.store(true, Ordering::SeqCst);
            return Ok(());
        }
        blk_cpu.observe(blk_pids(&guests));
        page_cluster = page_cluster.or_else(memfold_sys::reclaim::page_cluster);
        let now = start.elapsed().as_secs_f64();
        sampled_s = now;
        if let Some(every) = a
            .kill_memfoldd_every
            .filter(|&e| now - killed_at >= e as f64)
        {
            killed_at = now;
            kills += 1;
            eprintln!(
                "killing memfoldd (SIGKILL, kill {kills}, every {every} s) at {now:.0} s; restarting it"
            );
            // Read at the kill, not at the last sample: what it used since would be lost.
            cpu_dead += cpu_seconds(daemon.0.id(), None).max(cpu_last);
            cpu_last = 0.0;
            let _ = daemon.0.kill();
            let _ = daemon.0.wait();
            daemon = start_daemon()?;
        }
        let paused: Vec<String> = guests
            .iter()
            .filter(|g| g.is_stopped())
            .map(|g| g.name.clone())
            .collect();
        for g in guests.iter().filter(|g| paused.contains(&g.name)) {
            if !announced.contains(&g.name) {
                announced.push(g.name.clone());
                eprintln!(
                    "guest {}: paused (fail closed) at {:.0} s: its memfold agent could not serve a fault and stopped QEMU (pid {}) with guest RAM intact; {} says why. Inspect it with `gcore {}`; the run goes on and kills it at the end",
                    g.name,
                    start.elapsed().as_secs_f64(),
                    g.pid,
                    g.serial_path.with_file_name("qemu.stderr").display(),
                    g.pid
                );
            }
        }
        if let Some(status) = daemon.0.try_wait()? {
            restarts += 1;
            anyhow::ensure!(
                restarts <= MAX_DAEMON_RESTARTS,
                "memfoldd died again ({status}) after {MAX_DAEMON_RESTARTS} restarts: giving up (log: {})",
                log_path.display()
            );
            eprintln!(
                "memfoldd exited ({status}) at {:.0} s; restarting it (restart {restarts}; the agents re-attach)",
                start.elapsed().as_secs_f64()
            );
            cpu_dead += cpu_last;
            cpu_last = 0.0;
            daemon = start_daemon()?;
        }
        cpu_last = cpu_seconds(daemon.0.id(), None);
        let stats = match memfold_live::query_stats(&socket) {
            Ok(stats) => stats,
            Err(e) => {
                anyhow::ensure!(
                    now < ATTACH_WAIT_S || !samples.is_empty(),
                    "memfoldd never answered at {} in {ATTACH_WAIT_S} s: {e} (log: {})",
                    socket.display(),
                    log_path.display()
                );
                return Ok(());
            }
        };
        seen.extend(attached_names(&stats));
        if !attach_checked && now >= ATTACH_WAIT_S {
            attach_checked = true;
            let missing = unattached(guests.iter().map(|g| g.name.as_str()), &seen, &paused);
            anyhow::ensure!(
                missing.is_empty(),
                "the memfold agent of {} never attached to memfoldd in {ATTACH_WAIT_S} s: the guest would run unmanaged. Its QEMU log says why (lines with memfold-agent): {}",
                missing.join(", "),
                missing
                    .iter()
                    .filter_map(|n| guests.iter().find(|g| &g.name == n))
                    .map(|g| g.serial_path.with_file_name("qemu.stderr").display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let t = start.elapsed().as_secs_f64();
        let census = if censuses.due(t) {
            Some(crate::census::of_memfold(&socket, &stats)?)
        } else {
            None
        };
        // memfoldd's heap (its indexes, books, buffers) is memory the guests' saving
        // costs: in what they use, as KSM's rmap items are on the kit's side. memfold-blk's
        // apart, as its CPU is: most of it is a block device's own work (qcow2, I/O
        // buffers), which the kit's QEMUs do in their own heaps, counted on neither side.
        let own_bytes = memfold_sys::proc::rss_anon_bytes(daemon.0.id());
        let s = Sample {
            t,
            used_bytes: measure::used(&guests)?.0 + own_bytes,
            own_bytes,
            blk_bytes: blk_pids(&guests)
                .into_iter()
                .map(memfold_sys::proc::rss_anon_bytes)
                .sum(),
            stats,
            daemon_restarts: restarts + kills,
            paused,
            census,
        };
        view::print(used_before, &s, samples.last());
        samples.push(s);
        Ok(())
    })?;
    let memory_stall_pct = stall0.0.and_then(|us0| {
        let us1 = memfold_sys::reclaim::memory_stall_us().ok()?;
        Some(measure::stall_pct(
            us0,
            us1,
            stall0.1.elapsed().as_secs_f64(),
        ))
    });
    blk_cpu.observe(blk_pids(&guests));
    let blk_cpu_s = blk_cpu.seconds();
    // memfold-blk apart: most of its CPU is a block device's own work (qcow2, the I/O),
    // which the peer's guests do inside QEMU, counted on neither side.
    let cpu_s = cpu_dead + cpu_seconds(daemon.0.id(), None) + measure::agents_cpu_seconds(&guests)
        - agent_cpu0;
    drop(daemon);
    let throughput = measure::throughput(&guests, &plain, &since);
    let rates = measure::late_rates(&guests, &since);
    let around_break = m.break_sharing.as_ref().map_or(Vec::new(), |(_, at)| {
        measure::around_break(&guests, *at as f64)
    });
    let clock_rbits = guests
        .iter()
        .map(|g| {
            let taken = if g.qemu_log().contains(memfold_agent::PAGEMAP_CLOCK_LOG) {
                "pagemap"
            } else {
                "userfault"
            };
            (g.name.clone(), taken)
        })
        .collect();
    let mismatches = mismatches(guests.iter().chain(&plain));
    for g in guests.iter_mut().chain(plain.iter_mut()) {
        g.stop();
    }
    let interrupted = m.secs > 0 && sampled_s < m.secs as f64 && stop.load(Ordering::SeqCst);
    let (saved_bytes, t95_s) =
        measure::plateau(used_before, samples.iter().map(|s| (s.t, s.used_bytes)));
    let books_saved_bytes =
        measure::tail_mean(&samples, |s| s.t, |s| s.stats.saved_pages as f64 * 4096.0);
    Ok((
        MemfoldRun {
            used_before,
            saved_bytes,
            books_saved_bytes,
            t95_s,
            cpu_s,
            blk_cpu_s,
            mismatches,
            interrupted,
            page_cluster,
            memory_stall_pct,
            daemon_restarts: restarts,
            daemon_kills: kills,
            samples,
            throughput,
            rates,
            around_break,
            clock_rbits,
            backing_compressor,
        },
        out,
    ))
}

/// A flag set by Ctrl-C, SIGTERM or SIGHUP (`ctrlc`'s `termination`): a run stopped by
/// `timeout`, `kill` or a closed terminal puts back what it changed on the host (zswap,
/// the swap file, `vm.page-cluster`, KSM) as a Ctrl-C does.
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
    let summary = output::print_summary(&a.memfold, &r, &out);
    // A mismatch or a paused guest fails the run once its outputs are out; Ctrl-C is how
    // a run without --secs ends, so an early stop does not.
    ensure_clean("memfold run", &r.failures(), &out).and(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfold_wire::{Stats, VmStats};

    #[test]
    fn sigterm_stops_a_run_as_ctrl_c_does() {
        // Without `ctrlc`'s termination feature SIGTERM kills this test binary (seen):
        // a run stopped by `timeout` left its swap file on and `vm.page-cluster` at 0.
        let stop = ctrl_c_flag().unwrap();
        rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::TERM)
            .unwrap();
        let t = std::time::Instant::now();
        while !stop.load(Ordering::SeqCst) {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(5),
                "SIGTERM not caught"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// A bench fails when its memfoldd has exited, quoting the log's last line; a live one
    /// passes. Without the check (`ensure_alive` always `Ok`) the first assertion fails.
    #[test]
    fn a_bench_whose_memfoldd_exited_fails() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("memfoldd.log");
        std::fs::write(&log, "started\n<3>policy de needs the NRU clock\n\n").unwrap();
        let mut dead = Daemon(Command::new("true").spawn().unwrap());
        let t = std::time::Instant::now();
        while dead.0.try_wait().unwrap().is_none() {
            assert!(t.elapsed() < std::time::Duration::from_secs(10));
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let e = dead.ensure_alive(&log).unwrap_err().to_string();
        assert!(e.contains("needs the NRU clock"), "{e}");
        let mut live = Daemon(Command::new("sleep").arg("30").spawn().unwrap());
        live.ensure_alive(&log).unwrap();
        drop(live); // killed
    }

    #[test]
    fn a_managed_guest_never_listed_attached_is_unattached_unless_paused() {
        let vm = |name: &str, detached| VmStats {
            name: name.into(),
            detached,
            ..VmStats::default()
        };
        let stats = Stats {
            vms: vec![vm("web-1", false), vm("db-1", true)],
            ..Stats::default()
        };
        let mut seen: std::collections::BTreeSet<String> = attached_names(&stats).collect();
        let names = ["web-1", "db-1", "py-1", "web-2"];
        assert_eq!(
            unattached(names.into_iter(), &seen, &["web-2".to_string()]),
            ["db-1", "py-1"]
        );
        // Seen once (before a memfoldd restart, say): attached.
        seen.insert("db-1".into());
        assert_eq!(unattached(names.into_iter(), &seen, &[]), ["py-1", "web-2"]);
    }
}
