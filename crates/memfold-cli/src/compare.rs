//! `memfold compare`: the same guest set under memfold (`--policy`: the Difference Engine,
//! `de`, by default, or `sharing`, ...) and under a peer — Linux KSM (aggressive
//! settings), or the kernel's whole kit, KSM + zswap + proactive reclaim
//! (`--peer ksm+zswap`, [`crate::peer`]), optionally with free page reporting in the guests
//! (`--peer ksm+zswap+fpr`) — one after the other on fresh boots, measured the same way:
//! host memory saved and left, time to 95% of the plateau, CPU seconds, memory stall, and
//! with `--plain-twins` each workload's throughput against an unmanaged twin on each side.

use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};
use clap::Args;
use memfold_vm::launcher::RamBackend;

mod ksm_side;
pub use ksm_side::{ksm_side, KsmSide};

use crate::run::measure::{t95_text, tail_mean, MemfoldRun, Throughput, MIB};
use crate::run::{self, MemfoldArgs, RunArgs, Twins};

/// Arguments of `memfold compare`.
#[derive(Args, Clone, Debug)]
#[command(mut_arg("secs", |a| a.help("Seconds each side runs: memfoldd, then KSM (> 0)")))]
pub struct CompareArgs {
    /// The guests, memfoldd's settings, and how long each side runs.
    #[command(flatten)]
    pub memfold: MemfoldArgs,
    /// Transparent huge pages for the KSM side's QEMUs: `host` (the host's setting; QEMU
    /// asks for huge pages, so a first touch allocates 2 MiB and KSM's saving includes
    /// splitting them) or `off` (4 KiB pages, as memfold's memfd RAM has: both sides start
    /// from the same footprint).
    #[arg(long, value_enum, default_value_t = KsmThp::Host)]
    pub ksm_thp: KsmThp,
    /// The peer: `ksm` (KSM alone), `ksm+fpr` (KSM, and a virtio balloon with free page
    /// reporting in each of its guests), `ksm+zswap` (KSM, zswap with a swap file, and a
    /// Senpai-style controller lowering the QEMUs' memory cgroup limit while memory
    /// pressure stays under `--pressure-target`) or `ksm+zswap+fpr` (that, and a virtio
    /// balloon with free page reporting in each of the peer's guests).
    #[arg(long, value_enum, default_value_t = Peer::Ksm)]
    pub peer: Peer,
    /// Boot beside each guest, on both sides, a plain twin of its profile (memfold's side:
    /// no agent; the peer's: outside the reclaim cgroup, RAM not mergeable, no balloon),
    /// each pair pinned to one host CPU, and report each workload's throughput (total work
    /// / total time of its rounds) managed / plain ± 2 standard errors of the
    /// round-to-round noise (the twins taken as independent, which they are not), per
    /// side. Memory figures count the managed guests only.
    #[arg(long)]
    pub plain_twins: bool,
    /// With --plain-twins: boot the plain twin of each pair first (the managed one second),
    /// to tell an order effect from the manager's.
    #[arg(long, requires = "plain_twins")]
    pub plain_first: bool,
    /// The `ksm+zswap` controller's pressure target, % of time some task stalls on memory
    /// (Senpai's default: 0.1).
    #[arg(long, default_value_t = 0.1)]
    pub pressure_target: f64,
    /// The `ksm+zswap` controller's largest step down, % of the group's usage per
    /// interval (Senpai's default: 1).
    #[arg(long, default_value_t = 2.0)]
    pub reclaim_probe: f64,
    /// Seconds between the `ksm+zswap` controller's steps (Senpai's default: 6).
    #[arg(long, default_value_t = 2.0)]
    pub reclaim_interval: f64,
    /// The lowest the `ksm+zswap` controller takes the QEMUs' group, % of the guests' RAM
    /// (besides it never asks for more than the free swap can take).
    #[arg(long, default_value_t = 10.0)]
    pub reclaim_floor: f64,
    /// zswap's compressor for `ksm+zswap` (default: the first the kernel takes of zstd,
    /// deflate, lz4, lzo-rle, lzo).
    #[arg(long)]
    pub zswap_compressor: Option<String>,
}

/// The peer of `memfold compare`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Peer {
    /// KSM alone (aggressive).
    #[value(name = "ksm")]
    Ksm,
    /// KSM alone, with free page reporting in its guests (a virtio balloon; the guest
    /// kernel reports free 2 MiB blocks and QEMU discards them): issue 17's peer for
    /// free-page discard.
    #[value(name = "ksm+fpr")]
    KsmFpr,
    /// KSM + zswap + proactive reclaim.
    #[value(name = "ksm+zswap")]
    KsmZswap,
    /// KSM + zswap + proactive reclaim + free page reporting in the guests.
    #[value(name = "ksm+zswap+fpr")]
    KsmZswapFpr,
}

impl Peer {
    /// Its name on the command line and in `compare.json`.
    pub fn name(self) -> &'static str {
        match self {
            Peer::Ksm => "ksm",
            Peer::KsmFpr => "ksm+fpr",
            Peer::KsmZswap => "ksm+zswap",
            Peer::KsmZswapFpr => "ksm+zswap+fpr",
        }
    }

    /// Whether it is the kernel's kit (zswap and the reclaim controller), not KSM alone.
    pub fn is_kit(self) -> bool {
        !matches!(self, Peer::Ksm | Peer::KsmFpr)
    }

    /// Whether its guests report free pages (free page reporting).
    pub fn fpr(self) -> bool {
        matches!(self, Peer::KsmFpr | Peer::KsmZswapFpr)
    }
}

impl CompareArgs {
    /// The plain twins asked for (`None`: without `--plain-twins`).
    pub fn twins(&self) -> Option<Twins> {
        self.plain_twins.then_some(Twins {
            plain_first: self.plain_first,
        })
    }

    /// The memfold side's run: memfold's settings, with the plain twins asked for.
    pub fn memfold_run(&self) -> RunArgs {
        let mut r = RunArgs::without_twins(self.memfold.clone());
        r.plain_twins = self.plain_twins;
        r.plain_first = self.plain_first;
        r
    }

    /// The kit the peer runs (for `ksm+zswap` and `ksm+zswap+fpr`).
    pub fn kit(&self) -> crate::peer::Kit {
        crate::peer::Kit {
            pace: crate::peer::Pace {
                target: self.pressure_target / 100.0,
                max_probe: self.reclaim_probe / 100.0,
                interval_s: self.reclaim_interval,
                floor: self.reclaim_floor / 100.0,
            },
            compressor: self.zswap_compressor.clone(),
            fpr: self.peer.fpr(),
            twins: self.twins(),
        }
    }
}

/// Huge pages on the KSM side of `memfold compare` (and on the kit's).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KsmThp {
    /// As the host's THP setting says.
    Host,
    /// Off for the guests' QEMUs (PR_SET_THP_DISABLE).
    Off,
}

impl KsmThp {
    /// The guest RAM backing of the peer's QEMUs.
    pub fn backend(self) -> RamBackend {
        match self {
            KsmThp::Host => RamBackend::Anonymous,
            KsmThp::Off => RamBackend::AnonymousNoThp,
        }
    }
}

/// `memfold compare`.
pub fn run(a: &CompareArgs) -> Result<()> {
    let stop = run::ctrl_c_flag()?;
    anyhow::ensure!(
        a.memfold.secs > 0,
        "memfold compare needs --secs > 0 (each side runs that long)"
    );
    // The peer's controls are checked before the memfold half runs, not after it.
    anyhow::ensure!(
        std::path::Path::new("/sys/kernel/mm/ksm/run").exists(),
        "/sys/kernel/mm/ksm is missing: this kernel has no KSM (CONFIG_KSM), so compare has no peer to measure"
    );
    if a.peer.is_kit() {
        anyhow::ensure!(
            a.pressure_target > 0.0 && a.pressure_target < 100.0,
            "--pressure-target {} is not a percentage in (0, 100)",
            a.pressure_target
        );
        anyhow::ensure!(
            a.reclaim_probe > 0.0 && a.reclaim_probe < 100.0,
            "--reclaim-probe {} is not a percentage in (0, 100)",
            a.reclaim_probe
        );
        anyhow::ensure!(
            a.reclaim_interval >= 0.1 && a.reclaim_interval <= 3600.0,
            "--reclaim-interval {} s is not between 0.1 and 3600",
            a.reclaim_interval
        );
        anyhow::ensure!(
            (0.0..100.0).contains(&a.reclaim_floor),
            "--reclaim-floor {} is not a percentage in [0, 100)",
            a.reclaim_floor
        );
        memfold_sys::reclaim::memory_stall_us()
            .context("the ksm+zswap peer's controller needs memory PSI")?;
        memfold_sys::reclaim::zswap_pool().context("the ksm+zswap peer needs zswap")?;
        let root = memfold_sys::reclaim::MemCgroupRoot::detect()
            .context("the ksm+zswap peer needs a memory cgroup controller (v1 or v2)")?;
        eprintln!(
            "(the peer's QEMUs go into a memory cgroup {} under {})",
            root.version.name(),
            root.dir.display()
        );
    }
    if a.memfold.census.is_some() && a.peer.is_kit() {
        eprintln!("(--census: memfoldd's census is in memfold's CPU; the kit takes none)");
    }
    eprintln!("== memfold (policy {}) on the set", a.memfold.engine.policy);
    let (m, out) = run::measure(&a.memfold_run(), "compare", &stop)?;
    // Over the sampled window, as the kit's side is: not the boots and shutdown around it.
    let memfold_stall_pct = m.memory_stall_pct;
    run::write_outputs(&out, &m)?;
    if let Some(f) = memfold_side_ends_compare(&m, stop.load(Ordering::SeqCst)) {
        return run::ensure_clean("memfold compare", &f, &out);
    }
    if a.peer.is_kit() {
        return compare_kit(a, &m, memfold_stall_pct, &out, &stop);
    }

    eprintln!(
        "== Linux KSM (aggressive){} on the same set, booted afresh",
        if a.peer.fpr() {
            " with free page reporting"
        } else {
            ""
        }
    );
    let side = ksm_side(
        &a.memfold.set,
        a.twins(),
        a.ksm_thp,
        a.peer.fpr(),
        a.memfold.secs,
        a.memfold.census,
        &out,
        Some(&stop),
    )?;
    let (k, ksm_cpu_s, ksm_throughput) = (&side.run, side.cpu_s, &side.throughput);
    let (memfold_marks, ksm_marks) = (m.marks(), side.marks());
    let j = serde_json::json!({
        "guests": a.memfold.set.profiles,
        "secs": a.memfold.secs,
        "ksm_thp": a.ksm_thp,
        "peer": a.peer.name(),
        "ksm_free_page_reporting": a.peer.fpr(),
        "memfold_used_before_bytes": m.used_before,
        "ksm_used_before_bytes": k.used_before,
        "memfold_saved_bytes": m.saved_bytes,
        "ksm_saved_bytes": k.saved_bytes,
        // Where each side ends: anonymous THP-backed RAM (KSM) starts higher than memfd RAM.
        "memfold_used_after_bytes": m.used_before as f64 - m.saved_bytes,
        "ksm_used_after_bytes": k.used_before as f64 - k.saved_bytes,
        "memfold_books_saved_bytes": m.books_saved_bytes,
        "ksm_pages_sharing_bytes": k.ksm_sharing_bytes,
        "memfold_own_bytes": m.own_bytes(),
        "ksm_own_bytes": k.own_bytes,
        "memfold_t95_s": m.t95_s,
        "ksm_t95_s": k.t95_s,
        "memfold_cpu_s": m.cpu_s,
        "memfold_blk_cpu_s": m.blk_cpu_s,
        "memfold_daemon_restarts": m.daemon_restarts,
        "memfold_guest_mismatches": m.mismatches.len(),
        "memfold_marks": memfold_marks,
        "ksm_cpu_s": ksm_cpu_s,
        "ksm_census_cpu_s": k.census_cpu_s,
        "ksm_guest_mismatches": side.mismatches.len(),
        "ksm_marks": ksm_marks,
        "memfold_zero_policy": a.memfold.engine.zero,
        "memfold_policy": a.memfold.engine.policy,
        "memfold_saved_by_pages": m.end().map(|s| s.saved_by),
        "memfold_lifetime": m.end().map(|s| s.lifetime.clone()),
        "memfold_latency_us": m.end().map(|s| s.latency),
        "memfold_throughput": m.throughput,
        "memfold_guest_wait_pct": m.guest_wait_pct(),
        "memfold_free_page_reporting": a.memfold.free_page_reporting,
        "ksm_throughput": ksm_throughput,
        "memfold_captured": m.captured(),
        "memfold_events": m.end().map(crate::run::measure::GuestEvents::of),
        "ksm_captured": k.captured(),
    });
    std::fs::write(out.join("compare.json"), serde_json::to_vec_pretty(&j)?)?;
    if a.memfold.set.json {
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!(
            "memfold ({}): saved {:.1} MiB of {:.1} (95% after {} s, {:.1} CPU s)\nKSM:     saved {:.1} MiB of {:.1} (95% after {} s, {:.1} CPU s)\nratio memfold/KSM: {:.2}",
            a.memfold.engine.policy,
            m.saved_bytes / MIB,
            m.used_before as f64 / MIB,
            t95_text(m.t95_s),
            m.cpu_s,
            k.saved_bytes / MIB,
            k.used_before as f64 / MIB,
            t95_text(k.t95_s),
            ksm_cpu_s,
            m.saved_bytes / k.saved_bytes.max(1.0)
        );
        // Free page reporting discards during the boot, before the "before": compare what
        // each side leaves.
        println!(
            "host memory left (MiB): memfold {:.1}, {} {:.1}",
            (m.used_before as f64 - m.saved_bytes) / MIB,
            a.peer.name(),
            (k.used_before as f64 - k.saved_bytes) / MIB
        );
        if let Some(s) = m.end() {
            println!(
                "memfold by mechanism at the end (books, MiB): {}",
                run::mechanisms_mib(&s.saved_by)
            );
        }
        for (side, c) in [("memfold", m.captured()), ("KSM", k.captured())] {
            if let Some(c) = c {
                println!("{side}: {}", c.line());
            }
        }
        print_sides(&m.throughput, "KSM-managed", ksm_throughput);
    }
    print_marks(
        &[("memfold", &memfold_marks), ("KSM", &ksm_marks)],
        a.memfold.set.json,
    );
    let failures = sides_failures(&m, &[("KSM", side.failures())]);
    run::ensure_clean("memfold compare", &failures, &out)
}

/// After memfold's side, the failures that end a compare there (its outputs written, the
/// peer not measured): a self-check mismatch (a guest's memory read wrong: there is no
/// comparison to make) or Ctrl-C/SIGTERM. A paused guest does not: the peer is measured
/// too and the compare fails at the end, with both sides' figures to read.
fn memfold_side_ends_compare(m: &MemfoldRun, interrupted: bool) -> Option<Vec<String>> {
    if m.mismatches.is_empty() && !interrupted {
        return None;
    }
    let mut f = m.failures();
    if interrupted {
        f.push("interrupted (Ctrl-C or SIGTERM) on memfold's side".into());
    }
    f.push("the peer was not measured".into());
    Some(f)
}

/// Every side's failures, named by side: memfold's ([`MemfoldRun::failures`]) and each
/// peer's. Any fails the compare once its outputs are written.
fn sides_failures(m: &MemfoldRun, peers: &[(&str, Vec<String>)]) -> Vec<String> {
    let memfold = m.failures().into_iter().map(|f| format!("memfold: {f}"));
    let peers = peers
        .iter()
        .flat_map(|(side, fs)| fs.iter().map(move |f| format!("{side}: {f}")));
    memfold.chain(peers).collect()
}

/// Each side's marks, `!! <side> MARKED: ...` (on stderr with `--json`, so that stdout
/// stays one JSON document).
fn print_marks(sides: &[(&str, &[String])], json: bool) {
    for (side, marks) in sides {
        for m in marks.iter() {
            if json {
                eprintln!("!! {side} MARKED: {m}");
            } else {
                println!("!! {side} MARKED: {m}");
            }
        }
    }
}

/// With plain twins: both sides' throughput tables (managed vs plain, ratio ± 2 s.e.),
/// printed by `memfold run`'s one function, then the ratios side by side per workload.
fn print_sides(memfold: &[Throughput], peer_side: &str, peer: &[Throughput]) {
    if memfold.is_empty() && peer.is_empty() {
        return;
    }
    run::print_throughput("memfold-managed", memfold);
    run::print_throughput(peer_side, peer);
    println!("guest speed, managed / plain (± 2 s.e.), per workload:");
    println!(
        "  {:<14} {:<10} {:>22} {:>22}",
        "workload", "guest", "memfold", peer_side
    );
    let cell = |t: Option<&Throughput>| {
        t.map_or("-".to_string(), |t| {
            if !t.measured() {
                return "NOT MEASURED".to_string();
            }
            format!(
                "{:.3}{}",
                t.ratio,
                t.change_2se.map_or(String::new(), |e| format!(" ± {e:.3}"))
            )
        })
    };
    // Both sides boot the same set in the same order: a managed guest has the same name
    // on both.
    let mut rows: Vec<(&str, &str)> = Vec::new();
    for t in memfold.iter().chain(peer) {
        if !rows.contains(&(t.metric.as_str(), t.guest.as_str())) {
            rows.push((t.metric.as_str(), t.guest.as_str()));
        }
    }
    fn find<'a>(side: &'a [Throughput], (metric, guest): (&str, &str)) -> Option<&'a Throughput> {
        side.iter().find(|t| t.metric == metric && t.guest == guest)
    }
    for row in rows {
        println!(
            "  {:<14} {:<10} {:>22} {:>22}",
            row.0,
            row.1,
            cell(find(memfold, row)),
            cell(find(peer, row))
        );
    }
}

/// The memfold half against the kernel's whole kit (`--peer ksm+zswap`).
fn compare_kit(
    a: &CompareArgs,
    m: &run::measure::MemfoldRun,
    memfold_stall_pct: Option<f64>,
    out: &std::path::Path,
    stop: &AtomicBool,
) -> Result<()> {
    eprintln!(
        "== the kernel's kit: KSM (aggressive) + zswap + proactive reclaim at {}% pressure{}, on the same set booted afresh",
        a.pressure_target,
        if a.peer == Peer::KsmZswapFpr { " + free page reporting" } else { "" }
    );
    let memfold_waits = m.guest_wait_pct();
    let mut set = a.memfold.set.clone();
    set.out = Some(out.join("peer"));
    let backend = a.ksm_thp.backend();
    let p = crate::peer::run_ksm_zswap(&set, backend, &a.kit(), a.memfold.secs, stop)?;
    crate::peer::write_csv(&out.join("peer").join("peer.csv"), &p)?;
    let memfold_left = m.used_before as f64 - m.saved_bytes;
    let peer_left = p.used_before as f64 - p.saved_bytes;
    let mut j = serde_json::json!({
        "guests": a.memfold.set.profiles,
        "secs": a.memfold.secs,
        "peer": a.peer.name(),
        "plain_twins": a.plain_twins,
        "plain_first": a.plain_first,
        "ksm_thp": a.ksm_thp,
        "pressure_target_pct": a.pressure_target,
        "zswap_compressor": p.compressor,
        "memfold_policy": a.memfold.engine.policy,
        "memfold_compress_backing": a.memfold.engine.compress_backing,
        "memfold_backing_compressor": m.backing_compressor,
        "memfold_used_before_bytes": m.used_before,
        "memfold_used_after_bytes": memfold_left,
        "memfold_saved_bytes": m.saved_bytes,
        "memfold_t95_s": m.t95_s,
        "memfold_cpu_s": m.cpu_s,
        "memfold_memory_stall_pct": memfold_stall_pct,
        "memfold_guest_wait_pct": memfold_waits,
        "memfold_free_page_reporting": a.memfold.free_page_reporting,
        "memfold_daemon_restarts": m.daemon_restarts,
        "peer_used_before_bytes": p.used_before,
        "peer_plain_twins_used_before_bytes": p.plain_used_before,
        "peer_used_after_bytes": peer_left,
        "peer_saved_bytes": p.saved_bytes,
        "peer_t95_s": p.t95_s,
        "peer_cpu_s": p.cpu_s,
        "peer_memory_stall_pct": p.stall_pct,
        "peer_guest_mismatches": p.mismatches.len(),
        "peer_senpai": p.senpai,
        "peer_free_page_reporting": p.fpr,
        "peer_cgroup": p.cgroup,
        "peer_oom_killer_off": p.oom_killer_off,
        "peer_controller": p.controller,
        "peer_oom_kills": p.oom_kills,
        "peer_oom_events": p.oom_events,
        "peer_under_oom_episodes": p.controller.under_oom_episodes,
        "peer_qemu_deaths": p.qemu_deaths,
        "peer_marks": p.marks(),
        "memfold_throughput": m.throughput,
        "peer_throughput": p.throughput,
        "left_ratio_memfold_over_peer": memfold_left / peer_left.max(1.0),
    });
    // Set apart: one `json!` this long passes the macro's recursion limit.
    for (k, v) in [
        ("memfold_blk_cpu_s", serde_json::json!(m.blk_cpu_s)),
        // Of what each side leaves, the mechanism's own memory (memfoldd's heap; KSM's
        // rmap items), and memfold-blk's, counted in neither: means over the last 10 s.
        ("memfold_own_bytes", m.own_bytes().into()),
        (
            "memfold_blk_bytes",
            tail_mean(&m.samples, |s| s.t, |s| s.blk_bytes as f64).into(),
        ),
        (
            "peer_own_bytes",
            tail_mean(&p.samples, |s| s.t, |s| s.own_bytes as f64).into(),
        ),
        ("memfold_guest_mismatches", m.mismatches.len().into()),
        ("memfold_marks", serde_json::json!(m.marks())),
        ("memfold_page_cluster", serde_json::json!(m.page_cluster)),
        ("peer_page_cluster", serde_json::json!(p.page_cluster)),
        ("peer_interrupted", p.interrupted.into()),
        ("census_secs", serde_json::json!(a.memfold.census)),
    ] {
        j[k] = v;
    }
    std::fs::write(out.join("compare.json"), serde_json::to_vec_pretty(&j)?)?;
    if a.memfold.set.json {
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!(
            "memfold ({}):            leaves {:.1} MiB of {:.1} (95% after {} s, {:.1} CPU s, memory stall {}, guests waiting on the agent {:.2}%)\nKSM + zswap + reclaim{} ({}% pressure target, {}): leaves {:.1} MiB of {:.1} (95% after {} s, {:.1} CPU s, memory stall {:.2}%)\nhost memory left, memfold / peer: {:.2}",
            a.memfold.engine.policy,
            memfold_left / MIB,
            m.used_before as f64 / MIB,
            t95_text(m.t95_s),
            m.cpu_s,
            memfold_stall_pct.map_or("-".into(), |s| format!("{s:.2}%")),
            memfold_waits.values().sum::<f64>(),
            if p.fpr { " + fpr" } else { "" },
            a.pressure_target,
            p.compressor,
            peer_left / MIB,
            p.used_before as f64 / MIB,
            t95_text(p.t95_s),
            p.cpu_s,
            p.stall_pct,
            memfold_left / peer_left.max(1.0)
        );
        print_sides(&m.throughput, "kit-managed", &p.throughput);
    }
    print_safety(&p, a.memfold.set.json);
    print_marks(&[("memfold", &m.marks())], a.memfold.set.json);
    // A guest that died, read its memory wrong or was paused, or a stop before --secs: the
    // compare fails, after its outputs (compare.json has the figures up to then, marked).
    let failures = sides_failures(m, &[("the kit", p.failures())]);
    run::ensure_clean("memfold compare", &failures, out)
}

/// The peer's safety line, under the table (on stderr with `--json`, so that stdout stays
/// one JSON document): its cgroup, whether the OOM killer was off, what the controller
/// did, and any mark.
fn print_safety(p: &crate::peer::PeerRun, json: bool) {
    let b = &p.controller;
    let line = format!(
        "peer safety: cgroup {}, OOM killer {}; controller steps {} (lowered {}, raised {}, refused {}, interrupted {}, reclaims {} ({} short), held at floor {}, swap nearly full {}, after OOM {}), lowest limit {}; under_oom episodes {}, rescues {}, OOM kills {}, OOM events {}, QEMU deaths {}",
        p.cgroup.name(),
        if p.oom_killer_off { "off for the group" } else { "on (v2: no memory.max set)" },
        b.steps,
        b.lowered,
        b.raised,
        b.refused,
        b.interrupted,
        b.reclaims,
        b.reclaims_short,
        b.held_at_floor,
        b.held_swap_full,
        b.held_after_oom,
        b.lowest_limit
            .map_or("-".into(), |l| format!("{:.1} MiB", l as f64 / MIB)),
        b.under_oom_episodes,
        b.rescues,
        p.oom_kills,
        p.oom_events.map_or("-".into(), |e| e.to_string()),
        p.qemu_deaths.len()
    );
    let marks = p
        .marks()
        .into_iter()
        .map(|m| format!("!! PEER RUN MARKED: {m}"));
    for l in std::iter::once(line).chain(marks) {
        if json {
            eprintln!("{l}");
        } else {
            println!("{l}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        compare: CompareArgs,
    }

    fn parse(args: &[&str]) -> Result<CompareArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("memfold-compare").chain(args.iter().copied()))
            .map(|c| c.compare)
    }

    #[test]
    fn the_fpr_peer_is_the_kit_with_free_page_reporting() {
        let a = parse(&["--peer", "ksm+zswap+fpr", "--pressure-target", "1"]).unwrap();
        assert_eq!(a.peer, Peer::KsmZswapFpr);
        assert!(a.peer.is_kit());
        assert_eq!(a.peer.name(), "ksm+zswap+fpr");
        let k = a.kit();
        assert!(k.fpr);
        assert_eq!(k.pace.target, 0.01);
        assert_eq!(k.twins, None);
        let z = parse(&["--peer", "ksm+zswap"]).unwrap();
        assert!(z.peer.is_kit() && !z.kit().fpr);
        let ksm = parse(&[]).unwrap();
        assert_eq!(ksm.peer, Peer::Ksm);
        assert!(!ksm.peer.is_kit() && !ksm.peer.fpr());
        let kf = parse(&["--peer", "ksm+fpr"]).unwrap();
        assert_eq!(kf.peer, Peer::KsmFpr);
        assert!(!kf.peer.is_kit() && kf.peer.fpr());
        assert!(parse(&["--peer", "fpr"]).is_err());
    }

    fn ksm_side(mismatches: &[&str], interrupted: bool) -> KsmSide {
        KsmSide {
            run: crate::ksm::KsmRun {
                mode: "aggressive",
                used_before: 0,
                saved_bytes: 0.0,
                ksm_sharing_bytes: 0.0,
                own_bytes: 0.0,
                t95_s: None,
                census_cpu_s: 0.0,
                interrupted,
                samples: vec![],
            },
            cpu_s: 0.0,
            throughput: vec![],
            mismatches: mismatches.iter().map(|m| m.to_string()).collect(),
        }
    }

    /// A mismatch on any side, or a paused guest on memfold's, fails the compare with
    /// each named; a clean pair of sides does not.
    #[test]
    fn any_sides_mismatch_or_a_paused_guest_fails_the_compare() {
        let out = std::path::Path::new("/tmp/out");
        let clean = MemfoldRun::default();
        assert!(sides_failures(&clean, &[("KSM", ksm_side(&[], false).failures())]).is_empty());
        let ksm = ksm_side(&["web-1: MEMFOLD-MISMATCH page 7"], false);
        let f = sides_failures(&clean, &[("KSM", ksm.failures())]);
        assert_eq!(
            f,
            ["KSM: self-check mismatch: web-1: MEMFOLD-MISMATCH page 7"]
        );
        let e = run::ensure_clean("memfold compare", &f, out)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("MEMFOLD-MISMATCH page 7") && e.contains("/tmp/out"),
            "{e}"
        );
        assert_eq!(ksm.marks(), ksm.failures());
        // memfold's paused guest: the peer is measured, then the compare fails.
        let mut paused = MemfoldRun::default();
        paused.samples.push(crate::run::measure::Sample {
            t: 40.0,
            used_bytes: 0,
            own_bytes: 0,
            blk_bytes: 0,
            stats: Default::default(),
            daemon_restarts: 0,
            paused: vec!["db-1".into()],
            census: None,
        });
        assert!(memfold_side_ends_compare(&paused, false).is_none());
        let f = sides_failures(&paused, &[("the kit", vec![])]);
        assert_eq!(f.len(), 1);
        assert!(
            f[0].starts_with("memfold: guest db-1 paused (fail closed) from 40 s"),
            "{f:?}"
        );
        // memfold's mismatch ends the compare before the peer.
        let bad = MemfoldRun {
            mismatches: vec!["py-1: MEMFOLD-MISMATCH".into()],
            ..MemfoldRun::default()
        };
        let f = memfold_side_ends_compare(&bad, false).unwrap();
        assert!(f[0].contains("py-1: MEMFOLD-MISMATCH") && f[1].contains("not measured"));
    }

    /// Ctrl-C on memfold's side skips the peer; on the peer's, its side fails.
    #[test]
    fn an_interrupted_compare_says_so_and_fails() {
        let clean = MemfoldRun::default();
        let f = memfold_side_ends_compare(&clean, true).unwrap();
        assert!(
            f[0].starts_with("interrupted") && f[1].contains("not measured"),
            "{f:?}"
        );
        let f = sides_failures(&clean, &[("KSM", ksm_side(&[], true).failures())]);
        assert_eq!(
            f,
            ["KSM: interrupted (Ctrl-C or SIGTERM) before its --secs"]
        );
    }

    #[test]
    fn plain_twins_go_to_both_sides() {
        let a = parse(&[
            "--profiles",
            "web,db",
            "--plain-twins",
            "--peer",
            "ksm+zswap+fpr",
        ])
        .unwrap();
        let t = Some(Twins { plain_first: false });
        assert_eq!(a.twins(), t);
        assert_eq!(a.kit().twins, t);
        let r = a.memfold_run();
        assert!(r.plain_twins && !r.plain_first);
        assert_eq!(r.twins(), t);
        let b = parse(&["--plain-twins", "--plain-first"]).unwrap();
        assert_eq!(b.kit().twins, Some(Twins { plain_first: true }));
        assert!(b.memfold_run().plain_first);
        let c = parse(&["--peer", "ksm+zswap"]).unwrap();
        assert_eq!(c.twins(), None);
        assert!(!c.memfold_run().plain_twins);
        assert!(
            parse(&["--plain-first"]).is_err(),
            "--plain-first needs --plain-twins"
        );
    }
}
