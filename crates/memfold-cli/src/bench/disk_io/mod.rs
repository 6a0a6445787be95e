//! `memfold bench disk-io`: guest disk throughput on memfold-blk (vhost-user-blk, issue 16)
//! against QEMU's own virtio-blk, side by side in one run (issue 16, "No slower I/O").
//!
//! Two `tiny` guests boot at once, one whose data disk memfold-blk serves (reporting every
//! page a read fills to memfoldd, as `memfold run --disk memfold` does) and one on QEMU's
//! virtio-blk, both over the same raw file, both with memfold's agent under one memfoldd
//! (`--no-memfoldd`: the devices alone). QEMU reads the file with `O_DIRECT` as
//! memfold-blk does (`--virtio-cached`: through the host's page cache, QEMU's default). Each runs `memfold-probe diskio` (images/
//! memfold-probe.rs): round after round of `O_DIRECT` reads — 4 KiB sequential, 4 KiB at
//! random offsets, 1 MiB sequential — timed by the guest. Only the rounds that began after
//! both guests were reading count, so both sides always ran under the same load (with
//! `--alternate`, each alone in turn: the other paused); the run stops when each side
//! has `--rounds` of them. Then, with `--workloads web,...`, a guest
//! pair per profile (root disk on memfold-blk's qcow2 overlay against QEMU's throw-away
//! overlay) runs its built-in workload side by side for `--workload-secs`.
//!
//! Under TCG (no KVM) a guest's I/O rate is bound by the emulated CPU, not the disk: the
//! two sides then compare the CPU cost of each device path as seen by the guest.
//!
//! Needs root (the agent's userfaultfd). Boots guests: on a shared host run it under
//! `flock /tmp/measure.lock`.

pub mod rounds;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use memfold_vm::launcher::{agent_env, BlkDisks, DataDisk, Guest, GuestSpec, RamBackend};
use serde::Serialize;

use crate::run::measure::{start_marks, throughput, ProcCpu, Throughput};
use crate::run::{companions, Daemon};
use memfold_cli::engine_args::EngineArgs;
use rounds::{compare, passes, Compared};

/// `memfold bench disk-io`'s flags.
#[derive(Args, Clone, Debug)]
pub struct DiskIoArgs {
    /// Rounds per side that count (each: the three passes, run while the other side ran).
    #[arg(long, default_value_t = 8)]
    pub rounds: usize,
    /// The data disk, MiB (random bytes, written once into the output folder).
    #[arg(long, default_value_t = 64)]
    pub disk_mib: u64,
    /// MiB each sequential pass reads.
    #[arg(long, default_value_t = 16)]
    pub seq_mib: u64,
    /// 4 KiB reads of the random pass.
    #[arg(long, default_value_t = 2048)]
    pub rand_reads: u64,
    /// RAM per guest, MiB.
    #[arg(long, default_value_t = 256)]
    pub mem_mib: u32,
    /// No memfoldd and no agents: the two devices alone (memfold-blk counts its landed
    /// pages itself).
    #[arg(long)]
    pub no_memfoldd: bool,
    /// QEMU's virtio-blk reads through the host's page cache (its default), not with
    /// `O_DIRECT` as memfold-blk does (the default here, `cache.direct=on`): the
    /// comparison of the disks as `memfold run` sets them up rather than of the devices.
    #[arg(long)]
    pub virtio_cached: bool,
    /// The sides take turns: once both read, one guest is paused (QMP `stop`: its vCPUs
    /// and clock stand still) while the other runs a few rounds, so each device path runs
    /// with the host's other core free of the other guest's vCPU — as a host whose vCPUs
    /// do not hold every core (KVM, or more cores than vCPUs) runs it. A round a pause
    /// fell in, or may have, is not counted. The run's wall time and CPU seconds include
    /// the pauses. Default: both at once, one vCPU a core.
    #[arg(long)]
    pub alternate: bool,
    /// Profiles whose built-in workload is compared too, a pair of guests each (e.g.
    /// `web,db`); none by default.
    #[arg(long, value_delimiter = ',')]
    pub workloads: Vec<String>,
    /// How long each workload pair runs after both are ready, s.
    #[arg(long, default_value_t = 180)]
    pub workload_secs: u64,
    /// memfoldd's engine (the flags `memfold run` takes).
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Output folder (default out/disk-io): `disk-io.json`, consoles, logs.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The whole run.
#[derive(Clone, Debug, Serialize)]
pub struct DiskIoRun {
    /// Acceleration (KVM or TCG).
    pub accel: String,
    /// Whether memfoldd and the agents ran.
    pub memfoldd: bool,
    /// Whether QEMU's virtio-blk read through the host's page cache (else `O_DIRECT`).
    pub virtio_cached: bool,
    /// Whether the sides took turns (`--alternate`), else both read at once.
    pub alternate: bool,
    /// Times a side was paused for the other's turn (`--alternate`; else 0).
    pub turns: u32,
    /// The data disk, MiB.
    pub disk_mib: u64,
    /// MiB per sequential pass.
    pub seq_mib: u64,
    /// 4 KiB reads per random pass.
    pub rand_reads: u64,
    /// Each kind of pass, memfold-blk against virtio-blk.
    pub passes: Vec<Compared>,
    /// Wall time of the I/O pair, s.
    pub io_secs: f64,
    /// CPU seconds of the memfold-blk process over the I/O pair's run (every pid its
    /// supervisor ran: never negative across a restart).
    pub blk_cpu_s: f64,
    /// CPU seconds of each QEMU over the I/O pair's run: memfold-blk's guest, virtio's.
    pub qemu_cpu_s: [f64; 2],
    /// The built-in workloads: each profile's memfold-blk guest (as "guest") against its
    /// virtio-blk twin ("twin").
    pub workloads: Vec<Throughput>,
}

/// CPU seconds (user + system) of process `pid` so far; 0 if it is gone.
fn cpu_s(pid: u32) -> f64 {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some((_, rest)) = s.rsplit_once(") ") else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // Fields 14 and 15 of stat (utime, stime), 11 and 12 after the state.
    (ticks(11) + ticks(12)) / 100.0
}

/// The pids of the memfold-blk processes serving `g`'s disks now (none while restarting).
fn blk_pids(g: &Guest) -> Vec<u32> {
    g.blk_processes()
        .into_iter()
        .filter_map(|(_, pid, _)| pid)
        .collect()
}

/// Runs the benchmark.
///
/// Errors: not root, images or guests that do not come up, a probe that fails, rounds
/// that do not come within the time allowed.
pub fn run(a: &DiskIoArgs) -> Result<()> {
    anyhow::ensure!(a.rounds >= 2, "--rounds at least 2 (a spread needs two)");
    anyhow::ensure!(
        a.seq_mib >= 1 && a.seq_mib <= a.disk_mib && a.rand_reads >= 1,
        "--seq-mib between 1 and --disk-mib, --rand-reads at least 1"
    );
    let (agent, daemon_bin) = companions()?;
    let mut profiles = vec!["tiny"];
    profiles.extend(a.workloads.iter().map(String::as_str));
    let (out, cache, accel) = super::prepare(&a.out, "disk-io", &profiles)?;
    let data = super::data_file(&out, a.disk_mib)?;
    let socket = out.join("memfoldd.sock");
    let daemon_log = out.join("memfoldd.log");
    let mut daemon = if a.no_memfoldd {
        None
    } else {
        let log = std::fs::File::create(&daemon_log)?;
        let _ = std::fs::remove_file(&socket);
        Some(Daemon(
            Command::new(&daemon_bin)
                .args(["--config", "none"])
                .arg("--socket")
                .arg(&socket)
                .args(a.engine.to_args())
                .stderr(log)
                .spawn()
                .with_context(|| format!("cannot start {}", daemon_bin.display()))?,
        ))
    };
    // Checked after the boots, the pair and each workload (`Daemon::ensure_alive`).
    let mut memfoldd_alive = || {
        daemon
            .as_mut()
            .map_or(Ok(()), |d| d.ensure_alive(&daemon_log))
    };
    let env = |spec: &GuestSpec| {
        if a.no_memfoldd {
            Vec::new()
        } else {
            agent_env(&agent, &socket, spec)
        }
    };
    let blk = |data: bool, root: bool| BlkDisks {
        data,
        data_overlay: false,
        root,
        binary: None,
        landed_socket: (!a.no_memfoldd).then(|| socket.clone()),
    };
    let t0 = Instant::now();
    let probe = format!("memfold.probe=diskio,{},{},{}", a.seq_mib, a.rand_reads, 16);
    let io_spec = |name: &str, on_blk: bool| GuestSpec {
        data_disk: Some(DataDisk {
            path: data.clone(),
            read_bytes_per_sec: None,
        }),
        memfold_blk: on_blk.then(|| blk(true, false)),
        data_disk_direct: !a.virtio_cached,
        kernel_args: Some(probe.clone()),
        ..GuestSpec::new(name, "tiny", a.mem_mib, RamBackend::Memfd)
    };
    let dir = out.join("io");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let (bs, vs) = (io_spec("blk", true), io_spec("virtio", false));
    let mut gb = Guest::start_with_env(&bs, &cache, &dir, accel, &env(&bs))?;
    let mut gv = Guest::start_with_env(&vs, &cache, &dir, accel, &env(&vs))?;
    // A memfoldd that refused its flags has exited by the time both guests booted.
    memfoldd_alive()?;
    // Looked up again at every poll: its supervisor may restart it under a new pid.
    let mut blk_cpu = ProcCpu::starting(blk_pids(&gb));
    let cpu0 = (cpu_s(gb.pid), cpu_s(gv.pid));
    let (cb, cv, turns) = io_pair(a, &mut gb, &mut gv, |gb| blk_cpu.observe(blk_pids(gb)))?;
    memfoldd_alive()?;
    blk_cpu.observe(blk_pids(&gb));
    let cpu = (
        blk_cpu.seconds(),
        cpu_s(gb.pid) - cpu0.0,
        cpu_s(gv.pid) - cpu0.1,
    );
    std::fs::write(dir.join("blk.console"), gb.serial())?;
    std::fs::write(dir.join("virtio.console"), gv.serial())?;
    gb.stop();
    gv.stop();
    let io_secs = t0.elapsed().as_secs_f64();
    let passes = compare(&cb, &cv);
    for c in &passes {
        eprintln!(
            "{:<8} memfold-blk {:>8.2} ± {:>6.2} MiB/s ({} rounds)   virtio-blk {:>8.2} ± {:>6.2} MiB/s ({} rounds)   ratio {:.3} ± {:.3}",
            c.kind, c.blk_mibps, c.blk_2se, c.blk_rounds, c.virtio_mibps, c.virtio_2se, c.virtio_rounds, c.ratio, c.ratio_2se
        );
    }
    eprintln!(
        "CPU s over the pair's run: memfold-blk {:.1}, QEMU (memfold-blk guest) {:.1}, QEMU (virtio guest) {:.1}",
        cpu.0, cpu.1, cpu.2
    );
    let mut workloads = Vec::new();
    for p in &a.workloads {
        let wdir = out.join(format!("workload-{p}"));
        let _ = std::fs::remove_dir_all(&wdir);
        std::fs::create_dir_all(&wdir)?;
        let spec = |name: String, on_blk: bool| GuestSpec {
            memfold_blk: on_blk.then(|| blk(false, true)),
            ..GuestSpec::new(&name, p, 512, RamBackend::Memfd)
        };
        let (bs, vs) = (
            spec(format!("{p}-blk"), true),
            spec(format!("{p}-virtio"), false),
        );
        let mut gb = Guest::start_with_env(&bs, &cache, &wdir, accel, &env(&bs))?;
        let mut gv = Guest::start_with_env(&vs, &cache, &wdir, accel, &env(&vs))?;
        for g in [&mut gb, &mut gv] {
            g.wait_ready(Duration::from_secs(600))?;
        }
        let marks: HashMap<_, _> = start_marks([&gb, &gv].into_iter());
        eprintln!(
            "{p}: both ready after {:.0} s; {} s side by side",
            t0.elapsed().as_secs_f64(),
            a.workload_secs
        );
        let end = Instant::now() + Duration::from_secs(a.workload_secs);
        while Instant::now() < end {
            gb.check_alive()?;
            gv.check_alive()?;
            std::thread::sleep(Duration::from_secs(1));
        }
        for g in [&gb, &gv] {
            anyhow::ensure!(
                g.mismatches().is_empty(),
                "{}: self-check failed: {:?}",
                g.name,
                g.mismatches()
            );
        }
        memfoldd_alive()?;
        let t = throughput(std::slice::from_ref(&gb), std::slice::from_ref(&gv), &marks);
        for t in &t {
            eprintln!(
                "{p}: {} memfold-blk {:.2} ({} rounds), virtio-blk {:.2} ({} rounds): ratio {:.3} ± {:.3}",
                t.metric,
                t.managed,
                t.managed_rounds,
                t.plain,
                t.plain_rounds,
                t.ratio,
                t.change_2se.unwrap_or(f64::NAN)
            );
        }
        anyhow::ensure!(
            !t.is_empty() && t.iter().all(Throughput::measured),
            "{p}: no workload rounds reported by both guests in {} s ({})",
            a.workload_secs,
            crate::run::measure::unmeasured(&t).join("; ")
        );
        workloads.extend(t);
        std::fs::write(wdir.join("blk.console"), gb.serial())?;
        std::fs::write(wdir.join("virtio.console"), gv.serial())?;
    }
    let res = DiskIoRun {
        accel: format!("{accel:?}"),
        memfoldd: !a.no_memfoldd,
        virtio_cached: a.virtio_cached,
        alternate: a.alternate,
        turns,
        disk_mib: a.disk_mib,
        seq_mib: a.seq_mib,
        rand_reads: a.rand_reads,
        passes,
        io_secs,
        blk_cpu_s: cpu.0,
        qemu_cpu_s: [cpu.1, cpu.2],
        workloads,
    };
    let json = serde_json::to_string_pretty(&res)?;
    std::fs::write(out.join("disk-io.json"), &json)?;
    if a.json {
        println!("{json}");
    }
    eprintln!("wrote {}", out.join("disk-io.json").display());
    Ok(())
}

/// One side's counted rounds ([`rounds::counted`]): MiB and seconds of each kind of pass,
/// by round.
type Rounds = std::collections::BTreeMap<u64, rounds::Round>;

/// `--alternate`: counted rounds a side runs alone before the other's turn.
const ROUNDS_A_TURN: usize = 3;

/// `--alternate`'s turns: one side runs, the other is paused (QMP `stop`).
struct Turns {
    /// QMP sessions: memfold-blk's guest, virtio's.
    qmp: [memfold_vm::qmp::Qmp; 2],
    /// The side running (0: memfold-blk's guest, 1: virtio's).
    running: usize,
    /// The running side's counted rounds when its turn began.
    counted_at_turn: usize,
    /// Per side, the rounds a pause fell in or may have: the round under way when it was
    /// paused (by its console, which may lag by a pass) and the next.
    paused_in: [std::collections::BTreeSet<u64>; 2],
    /// Pauses so far.
    pauses: u32,
}

impl Turns {
    /// Pauses side `side` (QMP `stop`), then marks its round under way.
    fn pause(&mut self, side: usize, g: &Guest) -> Result<()> {
        self.qmp[side]
            .execute("stop", None)
            .with_context(|| format!("{}: QMP stop", g.name))?;
        self.mark_under_way(side, g);
        self.pauses += 1;
        Ok(())
    }

    /// Marks side `side`'s round under way by its console, and the next, as rounds a
    /// pause fell in or may have (the console may lag by a pass).
    fn mark_under_way(&mut self, side: usize, g: &Guest) {
        let u = rounds::under_way(&passes(&g.serial()));
        self.paused_in[side].extend([u, u + 1]);
    }

    /// Resumes side `side` (QMP `cont`).
    fn resume(&mut self, side: usize, g: &Guest) -> Result<()> {
        self.qmp[side]
            .execute("cont", None)
            .with_context(|| format!("{}: QMP cont", g.name))?;
        Ok(())
    }
}

/// Runs the I/O pair until each side has `a.rounds` rounds that began after both were
/// reading (`--alternate`: and that no pause fell in), calling `poll` with memfold-blk's
/// guest at each look; returns each side's counted rounds (memfold-blk's, virtio's) and
/// the pauses made for turns. Both guests run when it returns `Ok` (on an error one may
/// be left paused; stopping it with QMP `quit` works the same).
fn io_pair(
    a: &DiskIoArgs,
    gb: &mut Guest,
    gv: &mut Guest,
    mut poll: impl FnMut(&Guest),
) -> Result<(Rounds, Rounds, u32)> {
    let deadline = Instant::now() + Duration::from_secs(600 + 240 * a.rounds as u64);
    // Per side: the last round any pass of which was reported when the other side
    // started (None until both have started).
    let mut first: Option<(u64, u64)> = None;
    let mut turns: Option<Turns> = None;
    let mut progress = rounds::Progress::new(
        Instant::now(),
        rounds::Progress::limit_for(a.seq_mib, a.rand_reads),
    );
    loop {
        poll(gb);
        let (sb, sv) = (gb.serial(), gv.serial());
        for (g, s) in [(&*gb, &sb), (&*gv, &sv)] {
            if let Some(l) = s.lines().find(|l| l.contains("MEMFOLD-PROBE-FAILED")) {
                bail!("{}: {l}", g.name);
            }
        }
        let (pb, pv) = (passes(&sb), passes(&sv));
        let started = |s: &str| s.contains("MEMFOLD-IO-START");
        if first.is_none() && started(&sb) && started(&sv) {
            // The round under way on each side now (or 0) ran partly alone: skipped.
            // A round whose last pass is in was done: the next one is under way.
            first = Some((rounds::under_way(&pb), rounds::under_way(&pv)));
            let (fb, fv) = first.expect("just set");
            eprintln!(
                "both guests reading: counting from round {} (memfold-blk) and {} (virtio)",
                fb + 1,
                fv + 1
            );
        }
        if let (Some(_), true, None) = (first, a.alternate, &turns) {
            let mut t = Turns {
                qmp: [gb.qmp()?, gv.qmp()?],
                running: 0,
                counted_at_turn: 0,
                paused_in: Default::default(),
                pauses: 0,
            };
            t.pause(1, gv)?;
            // Memfold-blk's round under way now may have begun before the pause.
            t.mark_under_way(0, gb);
            eprintln!("taking turns: {ROUNDS_A_TURN} rounds a side while the other is paused");
            turns = Some(t);
            continue;
        }
        if let Some((fb, fv)) = first {
            let none = Default::default();
            let paused = |side: usize| turns.as_ref().map_or(&none, |t| &t.paused_in[side]);
            let (cb, cv) = (
                rounds::counted_except(&pb, fb, paused(0)),
                rounds::counted_except(&pv, fv, paused(1)),
            );
            let done = [cb.len() >= a.rounds, cv.len() >= a.rounds];
            if done[0] && done[1] {
                if let Some(mut t) = turns {
                    let stopped = 1 - t.running;
                    t.resume(stopped, [&*gb, &*gv][stopped])?;
                    return Ok((cb, cv, t.pauses));
                }
                return Ok((cb, cv, 0));
            }
            if let Some(t) = turns.as_mut() {
                let (run, other) = (t.running, 1 - t.running);
                let now = [cb.len(), cv.len()][run];
                let turn_over = now >= t.counted_at_turn + ROUNDS_A_TURN || done[run];
                if turn_over && !done[other] {
                    t.pause(run, [&*gb, &*gv][run])?;
                    t.resume(other, [&*gb, &*gv][other])?;
                    t.running = other;
                    t.counted_at_turn = [cb.len(), cv.len()][other];
                }
            }
        }
        gb.check_alive()?;
        gv.check_alive()?;
        let now = Instant::now();
        for (side, (g, p)) in [(&*gb, &pb), (&*gv, &pv)].into_iter().enumerate() {
            let running = turns.as_ref().is_none_or(|t| t.running == side);
            if let Some(idle) = progress.look(side, p.len(), running, now) {
                bail!(
                    "{}: no pass read in {:.0} s (its data disk does not answer; see its \
                     console, and for memfold-blk its log and memfoldd's)",
                    g.name,
                    idle.as_secs_f64()
                );
            }
        }
        if now > deadline {
            bail!("no {} rounds per side in time (see the consoles)", a.rounds);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
