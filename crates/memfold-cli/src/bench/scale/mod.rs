//! `memfold bench scale`: how memfold's costs grow with the number of guests and with
//! their size (issue 19), each point measured as `memfold compare` measures (memfold,
//! then KSM aggressive on a fresh boot of the same set).
//!
//! - **Guests** (`--vms 1,2,4,8,12,16`): the fraction of host memory saved as guests of
//!   one profile are added (ESX §5.2, Fig 4: the shared fraction rises toward 67% with
//!   10 VMs), time to 95%, CPU seconds per GiB saved.
//! - **Size** (`--sizes 512,2048,4096,8192`, MiB): the same workload in bigger guests:
//!   scan throughput (GiB read per memfoldd CPU second), mappings (VMAs) per QEMU against
//!   `vm.max_map_count`, share / CoW-break / decode latency p50 and p99, metadata (the
//!   engine's books and the agents' page records) per GiB of guest RAM (ESX §4.3: under
//!   0.5%), memfoldd's resident set.
//!
//! Each point's files (run.csv, the KSM side's ksm.csv, the guests' logs) go under
//! `OUT/g<N>-m<MiB>/`; the table is printed, and `scale.json`, `scale.csv` and
//! `scale.png` (each cost against the varied axis, with its least-squares slope) are
//! written to `OUT`. Guests in tests are small; the curves are commands
//! (docs/scale.md).

mod point;

use std::path::Path;

use anyhow::{Context, Result};
use clap::Args;

use crate::compare::{ksm_side, KsmThp};
use crate::plot::{self, Panel, Series};
use crate::run::{self, MemfoldArgs, RunArgs};
pub use point::{slope, Point};

/// Arguments of `memfold bench scale`.
#[derive(Args, Clone, Debug)]
#[command(mut_arg("profiles", |a| a
    .default_value("tiny")
    .help("The one guest profile every guest of every point runs")))]
#[command(mut_arg("secs", |a| a
    .default_value("90")
    .help("Seconds each side of each point runs (memfoldd, then KSM)")))]
pub struct ScaleArgs {
    /// memfold's side: the profile, the engine's settings, how long.
    #[command(flatten)]
    pub memfold: MemfoldArgs,
    /// Numbers of guests, comma-separated: one point each.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub vms: Vec<u32>,
    /// Guest sizes, MiB, comma-separated: one point each (with `--vms`, every pair).
    #[arg(long, value_delimiter = ',', default_value = "512")]
    pub sizes: Vec<u32>,
    /// Leave out the KSM side of each point (memfold's costs only; half the time).
    #[arg(long)]
    pub no_ksm: bool,
    /// Transparent huge pages on the KSM side (`off`: 4 KiB pages, as memfold's memfd
    /// RAM has).
    #[arg(long, value_enum, default_value_t = KsmThp::Off)]
    pub ksm_thp: KsmThp,
}

/// `memfold bench scale`.
pub fn run(a: &ScaleArgs) -> Result<()> {
    let stop = run::ctrl_c_flag()?;
    let profile = a.memfold.set.profiles.trim().to_string();
    anyhow::ensure!(
        !profile.is_empty() && !profile.contains(','),
        "memfold bench scale runs guests of one profile (--profiles {profile:?}): the points vary their number (--vms) and size (--sizes)"
    );
    anyhow::ensure!(
        a.memfold.set.mem_mib.is_none(),
        "memfold bench scale sets each point's guest size from --sizes, not --mem-mib"
    );
    anyhow::ensure!(
        a.memfold.secs >= 30,
        "--secs {} is under 30: a point needs its plateau",
        a.memfold.secs
    );
    anyhow::ensure!(
        !a.vms.is_empty() && a.vms.iter().all(|&n| (1..=64).contains(&n)),
        "--vms {:?}: each count must be 1 to 64",
        a.vms
    );
    anyhow::ensure!(
        !a.sizes.is_empty() && a.sizes.iter().all(|&m| (128..=65536).contains(&m)),
        "--sizes {:?}: each size must be 128 to 65536 MiB",
        a.sizes
    );
    let out = a.memfold.set.out_dir("scale");
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut points: Vec<Point> = Vec::new();
    let mut summary = None;
    // The VMA wall of each point is against this host's limit.
    let max_map_count = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok());
    for &mib in &a.sizes {
        for &n in &a.vms {
            if stop.load(std::sync::atomic::Ordering::SeqCst) {
                break;
            }
            let mut m = a.memfold.clone();
            m.set.profiles = vec![profile.as_str(); n as usize].join(",");
            m.set.mem_mib = Some(mib);
            m.set.json = false;
            let dir = out.join(format!("g{n}-m{mib}"));
            m.set.out = Some(dir.clone());
            eprintln!(
                "== point: {n} × {profile} of {mib} MiB, memfold ({}), {} s",
                m.engine.policy, m.secs
            );
            let (r, rout) = run::measure(&RunArgs::without_twins(m.clone()), "scale", &stop)?;
            run::write_outputs(&rout, &r)?;
            // A guest's memory read wrong ends the sweep, after the point's outputs.
            let mismatched = run::measure::mismatch_failures(&r.mismatches);
            run::ensure_clean("memfold bench scale", &mismatched, &rout)?;
            // Stopped meanwhile: the point is memfold's alone (a KSM side booted now would
            // return at once, and a zero-length run is no point).
            let ksm = if a.no_ksm || stop.load(std::sync::atomic::Ordering::SeqCst) {
                None
            } else {
                eprintln!("== point: {n} × {profile} of {mib} MiB, KSM aggressive, booted afresh");
                let k = ksm_side(
                    &m.set,
                    None,
                    a.ksm_thp,
                    false,
                    m.secs,
                    m.census,
                    &dir,
                    Some(&stop),
                )?;
                anyhow::ensure!(
                    k.mismatches.is_empty(),
                    "a guest on the KSM side reported a self-check mismatch: {:?}",
                    k.mismatches
                );
                // Interrupted before its --secs: not a measurement of the point.
                (!k.run.interrupted).then_some(k)
            };
            let p = Point::new(n, mib, &r, ksm.as_ref(), max_map_count);
            eprintln!("{}", p.line());
            points.push(p);
            summary = Some(write_all(&out, &points)?);
        }
    }
    let Some(summary) = summary else {
        anyhow::bail!("stopped before any point was measured");
    };
    if a.memfold.set.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
        return Ok(());
    }
    print_table(&points);
    println!("scale.json, scale.csv, scale.png: {}", out.display());
    Ok(())
}

/// Writes `scale.json`, `scale.csv` and `scale.png` for the points so far (after each
/// point: a long sweep stopped midway keeps what it measured); returns what
/// `scale.json` holds.
fn write_all(out: &Path, points: &[Point]) -> Result<serde_json::Value> {
    let x = axis(points);
    let slopes: serde_json::Map<String, serde_json::Value> = Point::COSTS
        .iter()
        .filter_map(|&(name, f)| {
            let pts: Vec<(f64, f64)> = points
                .iter()
                .filter_map(|p| Some((x.of(p), f(p)?)))
                .collect();
            Some((name.to_string(), serde_json::json!(slope(&pts)?)))
        })
        .collect();
    let j = serde_json::json!({
        "x": x.name(),
        "points": points,
        "slopes_per_x": slopes,
    });
    std::fs::write(out.join("scale.json"), serde_json::to_vec_pretty(&j)?)?;
    let mut f = crate::create_output(&out.join("scale.csv"))?;
    use std::io::Write;
    writeln!(f, "guests,mem_mib,{}", Point::COSTS.map(|c| c.0).join(","))?;
    for p in points {
        let cells: Vec<String> = Point::COSTS
            .iter()
            .map(|(_, f)| f(p).map_or(String::new(), |v| format!("{v:.4}")))
            .collect();
        writeln!(f, "{},{},{}", p.guests, p.mem_mib, cells.join(","))?;
    }
    f.flush()?;
    if points.len() >= 2 {
        plot_points(&out.join("scale.png"), points, x)?;
    }
    Ok(j)
}

/// What the points vary: the number of guests, or (all points of one count) guest size.
#[derive(Clone, Copy)]
enum Axis {
    Guests,
    GiB,
}

impl Axis {
    fn name(self) -> &'static str {
        match self {
            Axis::Guests => "guests",
            Axis::GiB => "GiB per guest",
        }
    }

    fn of(self, p: &Point) -> f64 {
        match self {
            Axis::Guests => p.guests as f64,
            Axis::GiB => p.mem_mib as f64 / 1024.0,
        }
    }
}

/// Guests if the points vary in number, else guest size.
fn axis(points: &[Point]) -> Axis {
    let first = points.first().map_or(0, |p| p.guests);
    if points.iter().any(|p| p.guests != first) {
        Axis::Guests
    } else {
        Axis::GiB
    }
}

/// One panel per cost shown, memfold's and KSM's lines together where both have it.
fn plot_points(path: &Path, points: &[Point], x: Axis) -> Result<()> {
    let line = |name: &str, f: fn(&Point) -> Option<f64>| Series {
        name: name.into(),
        points: points
            .iter()
            .filter_map(|p| Some((x.of(p), f(p)?)))
            .collect(),
    };
    let panel = |title: &str, series: Vec<Series>| Panel {
        title: title.into(),
        series: series
            .into_iter()
            .filter(|s| !s.points.is_empty())
            .collect(),
        markers: vec![],
    };
    let panels = vec![
        panel(
            "host memory saved, % of guest RAM used",
            vec![
                line("memfold", |p| Some(p.memfold_saved_pct)),
                line("KSM", |p| p.ksm_saved_pct),
            ],
        ),
        panel(
            "CPU s per GiB saved",
            vec![
                line("memfold", |p| p.memfold_cpu_s_per_gib_saved),
                line("KSM (ksmd)", |p| p.ksm_cpu_s_per_gib_saved),
            ],
        ),
        panel(
            "time to 95% of the saving, s",
            vec![
                line("memfold", |p| p.memfold_t95_s),
                line("KSM", |p| p.ksm_t95_s),
            ],
        ),
        panel(
            "metadata, % of guest RAM (engine books + agents' page records; memfoldd RSS)",
            vec![
                line("books + agents", |p| Some(p.metadata_pct)),
                line("books + agents, most in the 2nd half", |p| {
                    Some(p.metadata_late_max_pct)
                }),
                line("memfoldd RSS", |p| Some(p.memfoldd_rss_pct)),
            ],
        ),
        panel(
            "mappings (VMAs) of the largest QEMU",
            vec![line("memfold", |p| Some(p.max_qemu_mappings as f64))],
        ),
        panel(
            "latency p99, µs",
            vec![
                line("share", |p| p.share_p99_us),
                line("CoW break", |p| p.cow_break_p99_us),
                line("decode (unstash)", |p| p.unstash_p99_us),
            ],
        ),
    ];
    plot::panels(path, "memfold bench scale", x.name(), "", &panels)
}

/// The points as a table on stdout.
fn print_table(points: &[Point]) {
    println!(
        "{:>6} {:>7} {:>9} {:>8} {:>8} {:>7} {:>7} {:>9} {:>9} {:>8} {:>7} {:>8} {:>9} {:>9}",
        "guests",
        "MiB",
        "used MiB",
        "saved %",
        "KSM %",
        "t95 s",
        "KSM t95",
        "CPU/GiB",
        "KSM C/GiB",
        "meta %",
        "RSS %",
        "VMAs max",
        "scan GiB/s",
        "share p99"
    );
    let o = |v: Option<f64>, d: usize| v.map_or("-".to_string(), |v| format!("{v:.d$}"));
    for p in points {
        println!(
            "{:>6} {:>7} {:>9.1} {:>8.1} {:>8} {:>7} {:>7} {:>9} {:>9} {:>8.3} {:>7.3} {:>8} {:>9} {:>9}",
            p.guests,
            p.mem_mib,
            p.memfold_used_before_mib,
            p.memfold_saved_pct,
            o(p.ksm_saved_pct, 1),
            o(p.memfold_t95_s, 1),
            o(p.ksm_t95_s, 1),
            o(p.memfold_cpu_s_per_gib_saved, 2),
            o(p.ksm_cpu_s_per_gib_saved, 2),
            p.metadata_pct,
            p.memfoldd_rss_pct,
            p.max_qemu_mappings,
            o(p.scan_gib_per_cpu_s, 2),
            o(p.share_p99_us, 0),
        );
    }
}
