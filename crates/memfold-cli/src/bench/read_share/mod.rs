//! `memfold bench read-share`: how soon a page a guest reads, that another guest already
//! holds, is shared (issue 16, "Sooner"), for memfold with memfold-blk (shared at read),
//! memfold on QEMU's disks (its scan alone) and KSM aggressive.
//!
//! Per side, a `holder` guest reads the first `--rounds × --pages` pages of a data disk of
//! random bytes into its page cache and keeps them; then a `reader` guest reads the same
//! pages, `--pages` a round, `--chunk` pages at a time (images/memfold-probe.rs): before
//! each chunk it says so on its console, after it it prints the chunk's guest frames. The
//! host follows the reader's console and every millisecond or so asks, of each page read
//! and not yet shared, whether it is shared now (`watch.rs`: a hole in the reader's RAM
//! memfd for memfold, a KSM frame under it for KSM). A page's time runs from the host
//! seeing its chunk's read begin to the host seeing it shared: it includes the read itself
//! and the host's polling (both in the output).
//!
//! Needs root. Boots guests: on a shared host run it under `flock /tmp/measure.lock`.

pub mod timeline;
pub mod watch;

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use memfold_sys::ksm::{Ksm, KsmMode};
use memfold_vm::launcher::{agent_env, Accel, BlkDisks, DataDisk, Guest, GuestSpec, RamBackend};
use serde::Serialize;

use crate::run::{companions, Daemon};
use memfold_cli::engine_args::EngineArgs;
use timeline::{summarize, PageTime, Summary, Tracker};
use watch::{KsmFlags, MemfdHoles, Shared};

/// `memfold bench read-share`'s flags.
#[derive(Args, Clone, Debug)]
pub struct ReadShareArgs {
    /// The sides, in order: `blk` (memfold, memfold-blk disks: shared at read), `scan`
    /// (memfold, QEMU's disks: the scan alone), `ksm` (KSM aggressive, QEMU's disks).
    #[arg(long, value_delimiter = ',', default_value = "blk,scan,ksm")]
    pub sides: Vec<String>,
    /// Rounds: each reads the next `--pages` pages.
    #[arg(long, default_value_t = 8)]
    pub rounds: usize,
    /// Pages per round.
    #[arg(long, default_value_t = 512)]
    pub pages: usize,
    /// Pages read at a time.
    #[arg(long, default_value_t = 8)]
    pub chunk: usize,
    /// Between chunks, ms.
    #[arg(long, default_value_t = 20)]
    pub gap_ms: u64,
    /// Between rounds, s.
    #[arg(long, default_value_t = 5.0)]
    pub round_gap_secs: f64,
    /// How long the reader waits after it boots before its first read, s (memfoldd's
    /// attach and first scans, KSM's first passes over the new guest).
    #[arg(long, default_value_t = 20.0)]
    pub settle_secs: f64,
    /// A page not shared this long after its read counts as not shared, s.
    #[arg(long, default_value_t = 60.0)]
    pub timeout_secs: f64,
    /// KSM's `smart_scan` on the KSM side (Linux 6.7+: pages that did not merge are
    /// skipped for up to 8 passes): `on`, `off`, or `host` (left as it is). Put back
    /// afterwards.
    #[arg(long, default_value = "host", value_parser = clap::builder::PossibleValuesParser::new(["host", "on", "off"]))]
    pub ksm_smart_scan: String,
    /// RAM per guest, MiB (under 2 GiB: guest-physical addresses are memfd offsets).
    #[arg(long, default_value_t = 256)]
    pub mem_mib: u32,
    /// memfoldd's engine on the memfold sides (the flags `memfold run` takes; a policy
    /// that only shares: `--policy sharing`).
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Output folder (default out/read-share): `read-share.json`, consoles, logs.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// One side's result.
#[derive(Clone, Debug, Serialize)]
pub struct Side {
    /// `blk`, `scan` or `ksm`.
    pub side: String,
    /// The latencies.
    pub summary: Summary,
    /// Mean of the host's polling period while pages were in flight, ms (the resolution).
    pub poll_ms: f64,
    /// Median time the reader took per chunk, from its `R` line to its `G` line as the
    /// host saw them, ms (in every page's time).
    pub chunk_read_ms: f64,
    /// memfoldd's own `share_at_read` latency (device write to the agent's answer):
    /// count, p50 and p99 µs; `None` on the KSM side.
    pub share_at_read: Option<memfold_wire::LatencySummary>,
    /// The reader's pages as memfoldd booked them over its life; `None` on the KSM side.
    pub reader_books: Option<ReaderBooks>,
    /// Every page's time.
    pub pages: Vec<PageTime>,
}

/// The reader guest's counters at the end of a memfold side: what its reads came to.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct ReaderBooks {
    /// Pages its data disk reported landed (memfold-blk's `--stats`: base, overlay and
    /// zero pages; 0 on QEMU's disk).
    pub device_landed: u64,
    /// Of those, pages memfoldd looked up at read (private when the report came; the
    /// rest were passed over to the scan).
    pub looked_up: u64,
    /// Shares made at read (the reader's pages and their twins in the holder).
    pub read_shares: u64,
    /// All its shares (scan and read).
    pub shares: u64,
    /// Its copy-on-write breaks.
    pub cow_breaks: u64,
}

/// Pages memfold-blk says it reported landed (`landed_base`, `landed_overlay`,
/// `landed_zero` in its `--stats` file); 0 without the file.
fn device_landed(stats: &Path) -> u64 {
    let s = std::fs::read_to_string(stats).unwrap_or_default();
    s.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .filter(|(k, _)| k.starts_with("landed_"))
        .filter_map(|(_, v)| v.parse::<u64>().ok())
        .sum()
}

/// The whole run.
#[derive(Clone, Debug, Serialize)]
pub struct ReadShareRun {
    /// Acceleration (KVM or TCG).
    pub accel: String,
    /// The flags of the run, as given.
    pub rounds: usize,
    /// Pages per round.
    pub pages: usize,
    /// Pages per chunk.
    pub chunk: usize,
    /// memfoldd's scan rate, pages/s.
    pub rate: u64,
    /// KSM's `smart_scan` on the KSM side (`host`: as the host had it).
    pub ksm_smart_scan: String,
    /// The host's `smart_scan` when the run began (`None`: the kernel has none).
    pub host_smart_scan: Option<String>,
    /// Each side.
    pub sides: Vec<Side>,
}

/// Runs the benchmark.
///
/// Errors: not root, an unknown side, a policy that stashes, guests that do not come
/// up, a probe that fails, a detector that cannot read its guest.
pub fn run(a: &ReadShareArgs) -> Result<()> {
    anyhow::ensure!(
        ["sharing", "share-only"].contains(&a.engine.policy.as_str()),
        "--policy sharing or share-only: a page stashed by another policy is a hole too, which the benchmark would take for shared"
    );
    anyhow::ensure!(a.mem_mib < 2048 && a.rounds >= 1 && a.pages >= 1 && a.chunk >= 1);
    for s in &a.sides {
        anyhow::ensure!(
            ["blk", "scan", "ksm"].contains(&s.as_str()),
            "unknown side {s} (blk, scan, ksm)"
        );
    }
    let (agent, daemon) = companions()?;
    let (out, cache, accel) = super::prepare(&a.out, "read-share", &["tiny"])?;
    let held = a.rounds * a.pages;
    let data = super::data_file(&out, (held as u64).div_ceil(256).max(1))?;
    let mut res = ReadShareRun {
        accel: format!("{accel:?}"),
        rounds: a.rounds,
        pages: a.pages,
        chunk: a.chunk,
        rate: a.engine.rate,
        ksm_smart_scan: a.ksm_smart_scan.clone(),
        host_smart_scan: std::fs::read_to_string(SMART_SCAN)
            .ok()
            .map(|s| s.trim().into()),
        sides: Vec::new(),
    };
    for s in &a.sides {
        let side = side(a, s, &out.join(s), &data, &cache, accel, &agent, &daemon)?;
        let m = &side.summary;
        let t95: Vec<f64> = m.t95_s.iter().flatten().copied().collect();
        let (t95_mean, t95_2se) = super::disk_io::rounds::mean_2se(&t95);
        eprintln!(
            "{s:<5} pages {} unshared {}: p50 {:.1} ms, p99 {}, max {:.1} ms; 95% of a round shared after {:.2} ± {:.2} s ({} of {} rounds); poll {:.2} ms, chunk read {:.1} ms{}",
            m.pages,
            m.unshared,
            m.p50_ms,
            m.p99_ms.map_or("—".into(), |v| format!("{v:.1} ms")),
            m.max_ms,
            t95_mean,
            t95_2se,
            t95.len(),
            m.t95_s.len(),
            side.poll_ms,
            side.chunk_read_ms,
            side.share_at_read.map_or(String::new(), |l| format!(
                "; memfoldd share_at_read: {} shares, p50 {:.1} ms, p99 {:.1} ms",
                l.count,
                l.p50_us / 1e3,
                l.p99_us / 1e3
            )),
        );
        if let Some(b) = side.reader_books {
            eprintln!(
                "      reader: {} pages landed (device), {} looked up at read, {} shares at read of {} shares, {} CoW breaks",
                b.device_landed, b.looked_up, b.read_shares, b.shares, b.cow_breaks
            );
        }
        res.sides.push(side);
    }
    let json = serde_json::to_string_pretty(&res)?;
    std::fs::write(out.join("read-share.json"), &json)?;
    if a.json {
        println!("{json}");
    }
    eprintln!("wrote {}", out.join("read-share.json").display());
    Ok(())
}

/// One side: its sharer (memfoldd or KSM), the holder until it holds the pages, the
/// reader followed page by page until it is done and no page is in flight.
#[allow(clippy::too_many_arguments)]
fn side(
    a: &ReadShareArgs,
    which: &str,
    dir: &Path,
    data: &Path,
    cache: &Path,
    accel: Accel,
    agent: &Path,
    daemon_bin: &Path,
) -> Result<Side> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let socket = dir.join("memfoldd.sock");
    let ksm = which == "ksm";
    let mut _daemon = None;
    let mut _ksm = None;
    let mut _smart = None;
    if ksm {
        if a.ksm_smart_scan != "host" {
            _smart = Some(SmartScan::set(a.ksm_smart_scan == "on")?);
        }
        let k = Ksm::take_control()?;
        // From nothing merged (run = 2 unmerges), then aggressive from the first boot.
        k.unmerge()?;
        k.start(KsmMode::AGGRESSIVE)?;
        _ksm = Some(k);
    } else {
        let log = std::fs::File::create(dir.join("memfoldd.log"))?;
        _daemon = Some(Daemon(
            Command::new(daemon_bin)
                .args(["--config", "none"])
                .arg("--socket")
                .arg(&socket)
                .args(a.engine.to_args())
                .stderr(log)
                .spawn()
                .with_context(|| format!("cannot start {}", daemon_bin.display()))?,
        ));
    }
    let held = a.rounds * a.pages;
    let spec = |name: &str, probe: String| GuestSpec {
        data_disk: Some(DataDisk {
            path: data.to_path_buf(),
            read_bytes_per_sec: None,
        }),
        memfold_blk: (which == "blk").then(|| BlkDisks {
            data: true,
            landed_socket: Some(socket.clone()),
            ..BlkDisks::default()
        }),
        kernel_args: Some(format!("memfold.probe={probe}")),
        ..GuestSpec::new(
            name,
            "tiny",
            a.mem_mib,
            if ksm {
                RamBackend::AnonymousNoThp
            } else {
                RamBackend::Memfd
            },
        )
    };
    let start = |s: &GuestSpec| {
        let env = if ksm {
            Vec::new()
        } else {
            agent_env(agent, &socket, s)
        };
        Guest::start_with_env(s, cache, dir, accel, &env)
    };
    let hs = spec("holder", format!("holder,{held}"));
    let mut holder = start(&hs)?;
    wait_for(&mut holder, "MEMFOLD-PROBE-HELD", Duration::from_secs(600))?;
    eprintln!("{which}: holder holds {held} pages");
    let rs = spec(
        "reader",
        format!(
            "reader,0,{},{},{},{},{},{}",
            a.pages,
            a.chunk,
            a.gap_ms,
            a.rounds,
            (a.round_gap_secs * 1e3) as u64,
            (a.settle_secs * 1e3) as u64
        ),
    );
    let mut reader = start(&rs)?;
    // QEMU maps guest RAM a moment after it starts.
    let found = Instant::now();
    let w: Box<dyn Shared> = loop {
        let w: Result<Box<dyn Shared>> = if ksm {
            KsmFlags::of(reader.pid, a.mem_mib as u64 * 1024 * 1024).map(|w| Box::new(w) as _)
        } else {
            MemfdHoles::of(reader.pid, "memory-backend-memfd").map(|w| Box::new(w) as _)
        };
        match w {
            Ok(w) => break w,
            Err(e) if found.elapsed() > Duration::from_secs(30) => return Err(e),
            Err(_) => {
                reader.check_alive()?;
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    let (t, poll_ms, chunk_read_ms) = follow(a, &mut reader, &mut holder, w.as_ref())?;
    let (share_at_read, reader_books) = if ksm {
        (None, None)
    } else {
        let stats = memfold_live::query_stats(&socket)
            .with_context(|| format!("memfoldd at {}", socket.display()))?;
        let v = stats
            .vms
            .iter()
            .find(|v| v.name == "reader")
            .context("memfoldd does not list the reader")?;
        let books = ReaderBooks {
            device_landed: device_landed(&dir.join("reader").join("blk-data.stats")),
            looked_up: v.read_landed,
            read_shares: v.read_shares,
            shares: v.shares,
            cow_breaks: v.cow_breaks,
        };
        (Some(stats.latency.share_at_read), Some(books))
    };
    std::fs::write(dir.join("holder.console"), holder.serial())?;
    std::fs::write(dir.join("reader.console"), reader.serial())?;
    reader.stop();
    holder.stop();
    Ok(Side {
        side: which.into(),
        summary: summarize(&t.done, a.rounds as u64),
        poll_ms,
        chunk_read_ms,
        share_at_read,
        reader_books,
        pages: t.done,
    })
}

/// KSM's `smart_scan` set for a side, put back as it was when dropped.
struct SmartScan(String);

/// KSM's `smart_scan` switch.
const SMART_SCAN: &str = "/sys/kernel/mm/ksm/smart_scan";

impl SmartScan {
    /// Sets `smart_scan` to `on`, remembering the host's value.
    ///
    /// Errors: the kernel has no `smart_scan` (before 6.7), or it cannot be written.
    fn set(on: bool) -> Result<Self> {
        let was = std::fs::read_to_string(SMART_SCAN).with_context(|| SMART_SCAN.to_string())?;
        std::fs::write(SMART_SCAN, if on { "1" } else { "0" })
            .with_context(|| SMART_SCAN.to_string())?;
        Ok(SmartScan(was.trim().to_string()))
    }
}

impl Drop for SmartScan {
    fn drop(&mut self) {
        let _ = std::fs::write(SMART_SCAN, &self.0);
    }
}

/// Follows the reader's console and polls its pages in flight until it is done and none
/// is left; returns the tracker, the mean polling period while pages were in flight (ms)
/// and the median chunk read (ms).
fn follow(
    a: &ReadShareArgs,
    reader: &mut Guest,
    holder: &mut Guest,
    w: &dyn Shared,
) -> Result<(Tracker, f64, f64)> {
    let t0 = Instant::now();
    let mut t = Tracker::default();
    let mut serial = std::fs::File::open(&reader.serial_path)?;
    let mut at = 0u64;
    let mut buf = Vec::new();
    let (mut polls, mut poll_s) = (0u64, 0.0);
    let mut last_check = Instant::now();
    let mut r_seen: std::collections::HashMap<String, f64> = Default::default();
    let mut chunk_ms = Vec::new();
    let budget = 600.0
        + a.settle_secs
        + a.rounds as f64
            * (a.round_gap_secs
                + a.timeout_secs
                + (a.pages / a.chunk) as f64 * (a.gap_ms as f64 / 1e3 + 1.0));
    loop {
        let before = t0.elapsed().as_secs_f64();
        buf.clear();
        serial.seek(SeekFrom::Start(at))?;
        serial.read_to_end(&mut buf)?;
        at += buf.len() as u64;
        let now = t0.elapsed().as_secs_f64();
        if !buf.is_empty() {
            let text = String::from_utf8_lossy(&buf);
            for l in text.lines() {
                if let Some(k) = l.split("MEMFOLD-PROBE-R ").nth(1) {
                    r_seen.insert(k.trim().to_string(), now);
                } else if let Some(k) = l.split("MEMFOLD-PROBE-G ").nth(1) {
                    let key: Vec<&str> = k.split_whitespace().take(2).collect();
                    if let Some(r) = r_seen.get(&key.join(" ")) {
                        chunk_ms.push((now - r) * 1e3);
                    }
                }
                if l.contains("MEMFOLD-PROBE-FAILED") {
                    bail!("reader: {l}");
                }
            }
            t.feed(&text, now);
        }
        let flying = t.in_flight() > 0;
        t.poll(w, t0.elapsed().as_secs_f64(), a.timeout_secs)?;
        if t.reader_done && t.in_flight() == 0 {
            break;
        }
        if last_check.elapsed() > Duration::from_secs(1) {
            reader.check_alive()?;
            holder.check_alive()?;
            last_check = Instant::now();
            if t0.elapsed().as_secs_f64() > budget {
                bail!("reader not done within {budget:.0} s");
            }
        }
        std::thread::sleep(Duration::from_micros(500));
        if flying {
            polls += 1;
            poll_s += t0.elapsed().as_secs_f64() - before;
        }
    }
    chunk_ms.sort_by(f64::total_cmp);
    let median = chunk_ms
        .get(chunk_ms.len() / 2)
        .copied()
        .unwrap_or(f64::NAN);
    Ok((t, poll_s / polls.max(1) as f64 * 1e3, median))
}

/// Waits until `g`'s console says `marker`.
fn wait_for(g: &mut Guest, marker: &str, within: Duration) -> Result<()> {
    let t = Instant::now();
    loop {
        let s = g.serial();
        if s.contains(marker) {
            return Ok(());
        }
        if let Some(l) = s.lines().find(|l| l.starts_with("MEMFOLD-PROBE-FAILED")) {
            bail!("{}: {l}", g.name);
        }
        g.check_alive()?;
        if t.elapsed() > within {
            bail!("{}: no {marker} within {} s", g.name, within.as_secs());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
