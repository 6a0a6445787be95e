//! `memfold tradeoff`: host memory left against guest slowdown, every side of one or more
//! `memfold compare` runs on one chart and in one table (issue 15's proof: memfold's
//! policies, KSM, and the kernel's kit at several pressure targets, side by side).
//!
//! A side's **slowdown** is 1 − the geometric mean, over its managed guests' workloads, of
//! managed / plain-twin throughput (`--plain-twins`; each side's throughput is its total
//! work / total time since 2026-12-01, the mean of per-round rates before); its two
//! standard errors come from each workload's (delta method on the log: `se(log g) =
//! √Σ(se_i / r_i)² / k`), which cover the round-to-round noise only (the twins share a
//! CPU and rounds in a row are alike: the true error is larger). A side without twins, or
//! with a workload of one round, has no slowdown (or no error bar) and is listed but not
//! plotted; a workload with no rounds on one side leaves the side without a slowdown, and
//! marked. **Memory left** is the run's `*_used_after_bytes`: Pss of guest RAM (+ the
//! zswap pool for the kit), as `compare` measures it.
//!
//! A side is **marked** by what its run recorded (self-check mismatches, a paused guest, a
//! QEMU death, OOM signs, an early stop, an unmeasured workload): listed, never the best.
//!
//! The verdict per guest set follows the goal: memfold's best (least memory)
//! unmarked point against the best unmarked peer point (least memory, any setting), over
//! the same workloads; met when memfold leaves ≤ 0.75× its memory at a slowdown no larger
//! than the peer's (within two standard errors) and at no more CPU per second of run (the
//! best points may come from runs of different lengths).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Deserialize;

use crate::plot;
use crate::run::measure::MIB;

/// `memfold tradeoff` arguments.
#[derive(clap::Args)]
pub struct TradeoffArgs {
    /// `compare.json` files written by `memfold compare` (any peer, any set).
    #[arg(required = true)]
    pub runs: Vec<PathBuf>,
    /// Write the chart (memory left, MiB, against slowdown, %) here.
    #[arg(long)]
    pub png: Option<PathBuf>,
    /// Print the points as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// One workload's throughput pair as `compare.json` records it (`run::measure::Throughput`).
#[derive(Deserialize, Clone, Debug)]
struct Pair {
    metric: String,
    #[serde(default)]
    guest: String,
    ratio: f64,
    change_2se: Option<f64>,
    #[serde(default)]
    managed_rounds: Option<usize>,
    #[serde(default)]
    plain_rounds: Option<usize>,
}

impl Pair {
    /// Why its speed is not measured (no rounds on a side), if it is not.
    fn unmeasured(&self) -> Option<String> {
        let (m, p) = (self.managed_rounds, self.plain_rounds);
        (m == Some(0) || p == Some(0) || !(self.ratio > 0.0 && self.ratio.is_finite())).then(|| {
            format!(
                "{} {}: not measured ({} rounds managed, {} plain)",
                self.guest,
                self.metric,
                m.map_or("?".into(), |n| n.to_string()),
                p.map_or("?".into(), |n| n.to_string())
            )
        })
    }
}

/// The Senpai controller's settings as `compare.json` records them.
#[derive(Deserialize, Clone, Debug)]
struct Senpai {
    target: f64,
    max_probe: f64,
    #[serde(default)]
    interval_s: Option<f64>,
}

/// The fields of a `compare.json` this command reads; either `ksm_*` (`--peer ksm`) or
/// `peer_*` (the kit) describe the other side.
#[derive(Deserialize, Debug)]
struct CompareJson {
    guests: String,
    secs: u64,
    memfold_policy: String,
    memfold_used_after_bytes: f64,
    memfold_cpu_s: f64,
    memfold_t95_s: Option<f64>,
    memfold_throughput: Option<Vec<Pair>>,
    memfold_memory_stall_pct: Option<f64>,
    #[serde(default)]
    memfold_free_page_reporting: bool,
    memfold_guest_wait_pct: Option<BTreeMap<String, f64>>,
    /// What marked memfold's side; absent in runs from before 2026-12-01, whose marks are
    /// derived here (mismatch counts, unmeasured workloads).
    memfold_marks: Option<Vec<String>>,
    memfold_guest_mismatches: Option<u64>,
    peer: Option<String>,
    peer_memory_stall_pct: Option<f64>,
    /// What marked the peer's run (a QEMU death, an OOM kill or event, a task waiting
    /// under OOM); absent in runs from before the marks.
    #[serde(default)]
    peer_marks: Vec<String>,
    peer_used_after_bytes: Option<f64>,
    peer_cpu_s: Option<f64>,
    peer_t95_s: Option<f64>,
    peer_throughput: Option<Vec<Pair>>,
    peer_senpai: Option<Senpai>,
    peer_guest_mismatches: Option<u64>,
    ksm_used_after_bytes: Option<f64>,
    ksm_cpu_s: Option<f64>,
    ksm_t95_s: Option<f64>,
    ksm_throughput: Option<Vec<Pair>>,
    ksm_guest_mismatches: Option<u64>,
    #[serde(default)]
    ksm_marks: Vec<String>,
}

/// Which kind of side a point is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
enum Kind {
    /// memfold (any policy).
    Memfold,
    /// KSM alone.
    Ksm,
    /// KSM + zswap + proactive reclaim (+ free page reporting).
    Kit,
}

/// One side of one run.
#[derive(Clone, Debug, serde::Serialize)]
struct Point {
    /// The guest set (`web,web,db,py-trixie`).
    set: String,
    kind: Kind,
    /// What the side ran: `memfold de`, `ksm+zswap target 0.1% probe 2%/2s`.
    label: String,
    /// The run's file.
    run: String,
    secs: u64,
    /// Host memory left, MiB.
    left_mib: f64,
    /// Slowdown, % (None: no plain twins).
    slowdown_pct: Option<f64>,
    /// Two standard errors of the slowdown, percentage points (None: a workload had one
    /// round, or no twins).
    slowdown_2se_pct: Option<f64>,
    /// The workloads (metrics) that went into the slowdown.
    workloads: Vec<String>,
    /// `metric guest` of each workload: sides are compared over the same ones.
    #[serde(skip)]
    workload_keys: Vec<String>,
    /// CPU seconds (None: the run recorded none; the goal is then not met).
    cpu_s: Option<f64>,
    t95_s: Option<f64>,
    /// Self-check mismatches the run recorded for this side (None: not recorded).
    mismatches: Option<u64>,
    /// Host memory stall (PSI `some`) over the run, % (None: not recorded).
    stall_pct: Option<f64>,
    /// memfold only: its guests' waits on their agents' fault service, % of the run,
    /// summed over guests (PSI does not see them; None: not recorded).
    agent_wait_pct: Option<f64>,
    /// Why the run marked this side (a mismatch, a paused guest, a QEMU death, an OOM
    /// kill, an unmeasured workload): never the best point. Empty: clean.
    marks: Vec<String>,
}

impl Point {
    fn marked(&self) -> bool {
        !self.marks.is_empty()
    }
}

/// A side's marks: those its run recorded (`recorded`, new runs), else those the older
/// JSON shows (a self-check mismatch count, workloads with no rounds on a side).
fn side_marks(
    recorded: Option<Vec<String>>,
    mismatches: Option<u64>,
    pairs: &[Pair],
) -> Vec<String> {
    if let Some(m) = recorded {
        return m;
    }
    let mut m: Vec<String> = pairs.iter().filter_map(Pair::unmeasured).collect();
    if let Some(n) = mismatches.filter(|&n| n > 0) {
        m.insert(0, format!("{n} self-check mismatch(es)"));
    }
    m
}

/// Slowdown, % and its two standard errors (percentage points) from workload pairs; none
/// if a workload was not measured on a side (averaging the rest would leave it out).
fn slowdown(pairs: &[Pair]) -> (Option<f64>, Option<f64>) {
    if pairs.is_empty() || pairs.iter().any(|p| p.unmeasured().is_some()) {
        return (None, None);
    }
    let usable: Vec<&Pair> = pairs.iter().collect();
    let k = usable.len() as f64;
    let log_mean = usable.iter().map(|p| p.ratio.ln()).sum::<f64>() / k;
    let g = log_mean.exp();
    let var: Option<f64> = usable
        .iter()
        .map(|p| p.change_2se.map(|e| (e / 2.0 / p.ratio).powi(2)))
        .sum();
    let se_log = var.map(|v| v.sqrt() / k);
    (Some((1.0 - g) * 100.0), se_log.map(|s| 2.0 * s * g * 100.0))
}

/// The workloads of `pairs` (metrics, in order), as the table lists them.
fn metrics(pairs: Option<&[Pair]>) -> Vec<String> {
    pairs
        .unwrap_or_default()
        .iter()
        .map(|p| p.metric.clone())
        .collect()
}

/// The workloads as a set to compare sides by: `metric guest`, sorted.
fn workload_set(p: &Point) -> Vec<String> {
    let mut w = p.workload_keys.clone();
    w.sort();
    w
}

/// `metric guest` of each pair.
fn keys(pairs: Option<&[Pair]>) -> Vec<String> {
    pairs
        .unwrap_or_default()
        .iter()
        .map(|p| format!("{} {}", p.metric, p.guest))
        .collect()
}

/// The two points (memfold, the other side) of one `compare.json`.
fn points(path: &Path) -> Result<Vec<Point>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let j: CompareJson = serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: not a `memfold compare` JSON this version reads",
            path.display()
        )
    })?;
    let run = path.display().to_string();
    let (s, e) = slowdown(j.memfold_throughput.as_deref().unwrap_or_default());
    let mut out = vec![Point {
        set: j.guests.clone(),
        kind: Kind::Memfold,
        label: format!(
            "memfold {}{}",
            j.memfold_policy,
            if j.memfold_free_page_reporting {
                " + fpr"
            } else {
                ""
            }
        ),
        run: run.clone(),
        secs: j.secs,
        left_mib: j.memfold_used_after_bytes / MIB,
        slowdown_pct: s,
        slowdown_2se_pct: e,
        workloads: metrics(j.memfold_throughput.as_deref()),
        workload_keys: keys(j.memfold_throughput.as_deref()),
        cpu_s: Some(j.memfold_cpu_s),
        t95_s: j.memfold_t95_s,
        mismatches: j.memfold_guest_mismatches,
        stall_pct: j.memfold_memory_stall_pct,
        agent_wait_pct: j.memfold_guest_wait_pct.as_ref().map(|m| m.values().sum()),
        marks: side_marks(
            j.memfold_marks.clone(),
            j.memfold_guest_mismatches,
            j.memfold_throughput.as_deref().unwrap_or_default(),
        ),
    }];
    // The other side: the kit (or KSM through --peer ksm), or KSM's own compare.
    let (kind, label, left, cpu, t95, thr, mismatches, stall, recorded) =
        match (&j.peer, j.peer_used_after_bytes, j.ksm_used_after_bytes) {
            (Some(peer), Some(left), _) => (
                if peer == "ksm" { Kind::Ksm } else { Kind::Kit },
                match &j.peer_senpai {
                    Some(p) => format!(
                        "{peer} target {}% probe {}%/{}s",
                        p.target * 100.0,
                        p.max_probe * 100.0,
                        p.interval_s.unwrap_or(2.0)
                    ),
                    None => peer.clone(),
                },
                left,
                j.peer_cpu_s,
                j.peer_t95_s,
                j.peer_throughput.as_deref(),
                j.peer_guest_mismatches,
                j.peer_memory_stall_pct,
                &j.peer_marks,
            ),
            (_, _, Some(left)) => (
                Kind::Ksm,
                // `--peer ksm` with free page reporting writes "ksm+fpr".
                j.peer.clone().unwrap_or_else(|| "ksm".into()),
                left,
                j.ksm_cpu_s,
                j.ksm_t95_s,
                j.ksm_throughput.as_deref(),
                j.ksm_guest_mismatches,
                None,
                &j.ksm_marks,
            ),
            _ => anyhow::bail!(
                "{}: neither peer_used_after_bytes nor ksm_used_after_bytes: not a compare run",
                path.display()
            ),
        };
    let (s, e) = slowdown(thr.unwrap_or_default());
    // New runs record every mark; older ones recorded the kit's OOM signs only.
    let mut marks = recorded.clone();
    if j.memfold_marks.is_none() {
        marks.extend(side_marks(None, mismatches, thr.unwrap_or_default()));
    }
    out.push(Point {
        set: j.guests,
        kind,
        label,
        run,
        secs: j.secs,
        left_mib: left / MIB,
        slowdown_pct: s,
        slowdown_2se_pct: e,
        workloads: metrics(thr),
        workload_keys: keys(thr),
        cpu_s: cpu,
        t95_s: t95,
        mismatches,
        stall_pct: stall,
        agent_wait_pct: None,
        marks,
    });
    Ok(out)
}

/// The goal's verdict for one guest set (see the module's docs), one line.
fn verdict(points: &[&Point]) -> String {
    let best = |want: &dyn Fn(&Point) -> bool| {
        points
            .iter()
            .copied()
            .filter(|p| want(p) && !p.marked())
            .min_by(|a, b| a.left_mib.total_cmp(&b.left_mib))
    };
    let (Some(m), Some(p)) = (
        best(&|p| p.kind == Kind::Memfold),
        best(&|p| p.kind != Kind::Memfold),
    ) else {
        return "needs an unmarked memfold point and an unmarked peer point".into();
    };
    // A workload one side lacks would drop out of its slowdown: no comparison then.
    let (wm, wp) = (workload_set(m), workload_set(p));
    if !wm.is_empty() && !wp.is_empty() && wm != wp {
        return format!(
            "best memfold ({}) and best peer ({}) not compared: their workloads differ ({} against {})",
            m.label,
            p.label,
            wm.join(", "),
            wp.join(", ")
        );
    }
    let ratio = m.left_mib / p.left_mib;
    let mut why = Vec::new();
    if ratio > 0.75 {
        why.push(format!("memory {ratio:.2}× (goal ≤ 0.75×)"));
    }
    match (m.slowdown_pct, p.slowdown_pct) {
        (Some(ms), Some(ps)) => {
            // Two standard errors of the difference: the sides' errors add in quadrature.
            let slack = m
                .slowdown_2se_pct
                .unwrap_or(0.0)
                .hypot(p.slowdown_2se_pct.unwrap_or(0.0));
            if ms > ps + slack {
                why.push(format!("slowdown {ms:.1}% > {ps:.1}% + 2 s.e."));
            }
            if m.slowdown_2se_pct.is_none() || p.slowdown_2se_pct.is_none() {
                why.push("a slowdown without error bar (one round)".into());
            }
        }
        _ => why.push("no slowdown measured (run with --plain-twins)".into()),
    }
    // A missing figure fails: NaN would compare false and pass. Per second of run: the
    // best points of two sides may come from runs of different lengths (600 s, 240 s).
    let per_s = |cpu: Option<f64>, secs: u64| cpu.filter(|_| secs > 0).map(|c| c / secs as f64);
    match (per_s(m.cpu_s, m.secs), per_s(p.cpu_s, p.secs)) {
        (Some(mc), Some(pc)) if mc > pc => why.push(format!(
            "CPU {:.1}% of a core > {:.1}%",
            mc * 100.0,
            pc * 100.0
        )),
        (Some(_), Some(_)) => {}
        _ => why.push("CPU not measured".into()),
    }
    let head = format!(
        "best memfold ({}, {:.1} MiB) / best peer ({}, {:.1} MiB) = {ratio:.2}×",
        m.label, m.left_mib, p.label, p.left_mib
    );
    if why.is_empty() {
        format!("{head}: goal met")
    } else {
        format!("{head}: not met — {}", why.join("; "))
    }
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("—".into(), |x| format!("{x:.digits$}"))
}

/// The markdown table and a verdict per set.
fn table(points: &[Point]) -> String {
    let mut s = String::new();
    let mut sets: BTreeMap<&str, Vec<&Point>> = BTreeMap::new();
    for p in points {
        sets.entry(&p.set).or_default().push(p);
    }
    for (set, ps) in &sets {
        let _ = writeln!(s, "\n{set}\n");
        let _ = writeln!(
            s,
            "| side | s | memory left (MiB) | slowdown % (± 2 s.e.) | workloads | CPU s | time to 95% | memory stall % (PSI) | waits on the agent % | mismatches | run |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|");
        let mut ps = ps.clone();
        ps.sort_by(|a, b| {
            (a.kind, a.left_mib)
                .partial_cmp(&(b.kind, b.left_mib))
                .unwrap()
        });
        for p in &ps {
            let slow = match (p.slowdown_pct, p.slowdown_2se_pct) {
                (Some(x), Some(e)) => format!("{x:.1} ± {e:.1}"),
                (Some(x), None) => format!("{x:.1} (no s.e.)"),
                _ => "—".into(),
            };
            let _ = writeln!(
                s,
                "| {} | {} | {:.1} | {slow} | {} | {} | {} | {} | {} | {} | {} |",
                if p.marked() {
                    format!("{} (MARKED)", p.label)
                } else {
                    p.label.clone()
                },
                p.secs,
                p.left_mib,
                if p.workloads.is_empty() {
                    "—".to_string()
                } else {
                    p.workloads.join(", ")
                },
                fmt_opt(p.cpu_s, 1),
                fmt_opt(p.t95_s, 1),
                fmt_opt(p.stall_pct, 2),
                fmt_opt(p.agent_wait_pct, 2),
                p.mismatches.map_or("—".into(), |m| m.to_string()),
                Path::new(&p.run)
                    .file_name()
                    .map_or(p.run.clone(), |f| f.to_string_lossy().into_owned()),
            );
        }
        let mut marked = ps.iter().filter(|p| p.marked()).peekable();
        if marked.peek().is_some() {
            let _ = writeln!(s);
        }
        for p in marked {
            let _ = writeln!(
                s,
                "- {} ({}) MARKED: {}",
                p.label,
                p.run,
                p.marks.join("; ")
            );
        }
        let _ = writeln!(s, "\n{}", verdict(&ps));
    }
    s
}

/// Draws every point with a slowdown: x slowdown %, y memory left MiB, horizontal error
/// bars, one colour per kind of side.
fn chart(path: &Path, points: &[Point]) -> Result<usize> {
    let marks: Vec<plot::Mark> = points
        .iter()
        .filter_map(|p| {
            Some(plot::Mark {
                group: match p.kind {
                    Kind::Memfold => "memfold",
                    Kind::Ksm => "KSM",
                    Kind::Kit => "KSM + zswap + reclaim",
                }
                .to_string(),
                label: format!("{} ({})", p.label, p.set),
                x: p.slowdown_pct?,
                x_err: p.slowdown_2se_pct.unwrap_or(0.0),
                y: p.left_mib,
            })
        })
        .collect();
    plot::scatter(
        path,
        "Host memory left against guest slowdown",
        "slowdown vs plain twin, % (± 2 s.e.)",
        "host memory left, MiB",
        &marks,
    )?;
    Ok(marks.len())
}

/// Runs `memfold tradeoff`.
///
/// Errors: a file cannot be read or is not a compare run; the chart cannot be written.
pub fn run(a: &TradeoffArgs) -> Result<()> {
    let mut all = Vec::new();
    for r in &a.runs {
        all.extend(points(r)?);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&all)?);
    } else {
        print!("{}", table(&all));
    }
    if let Some(png) = &a.png {
        let n = chart(png, &all)?;
        eprintln!(
            "{}: {n} of {} points (those without plain twins have no slowdown)",
            png.display(),
            all.len()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests;
