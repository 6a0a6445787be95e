//! `memfold bench micro`: Difference Engine §5.3's micro-benchmark, through the engine core.
//!
//! One VM per (page type, mechanism) run. Its size is 4/3 of the allocated pages (the paper
//! allocates 75% of a 256 MB VM). It runs the engine memfoldd runs ([`Engine`](memfold_core::Engine)) over
//! in-memory guest RAM, with an in-memory agent (`memfold_core::sim::Rig`) carrying out its commands
//! at once and reporting its events at once. Time is simulated: every simulated second
//! the workload does its share of page operations through the agent (guest accesses:
//! CoW breaks, refills and decodes happen there), then the engine runs ten 100 ms steps of
//! its sharing scan (rate-limited to `scan_rate` pages/s) and NRU clock, then the books
//! are sampled.
//!
//! Phases, with `phase_secs` of stabilisation after each (the paper: 80 s): allocate (write
//! every page), read (every page, whole), write (one constant byte at 16 fixed offsets of
//! every page), free (the guest gives the pages back). "final" savings are measured at the
//! end of the stabilisation after the write phase, just before the free phase.

use std::path::PathBuf;
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use clap::Args;
use memfold_core::ids::Gfn;
use memfold_core::sim::Rig;
use memfold_core::{EngineConfig, Policy, PAGE_SIZE};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use serde::Serialize;

use crate::plot::{self, Panel, Series};

/// Page types of DE §5.3.
pub const PAGE_TYPES: [&str; 4] = ["zero", "random", "identical", "similar"];
/// Mechanism configurations: each alone, then all together (the DE policy).
pub const MECHANISMS: [&str; 4] = ["share", "patch", "compress", "all"];

/// Arguments of `memfold bench micro`.
#[derive(Args, Clone, Debug)]
pub struct MicroArgs {
    /// Pages the workload allocates in each VM (4 KiB each; the VM is 4/3 larger).
    #[arg(long, default_value_t = 16384)]
    pub pages: u32,
    /// Clock scan rate, pages per simulated second (DE and ESX's aggressive setting: 10000).
    #[arg(long, default_value_t = 10_000)]
    pub scan_rate: u32,
    /// Simulated seconds of stabilisation after each phase (DE: 80).
    #[arg(long, default_value_t = 80)]
    pub phase_secs: u32,
    /// Simulated seconds each workload phase lasts.
    #[arg(long, default_value_t = 10)]
    pub op_secs: u32,
    /// NRU clock interval, simulated seconds (DE §4.2: 4).
    #[arg(long, default_value_t = 4)]
    pub clock_secs: u32,
    /// Share of bytes changed in a "similar" page, percent (DE: 95%-similar pages → 5).
    #[arg(long, default_value_t = 5)]
    pub similar_diff_pct: u32,
    /// Folder for the CSV and PNG.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the results as JSON on stdout (per page type and mechanism: peak and final
    /// savings as fractions, and faults) instead of the tables.
    #[arg(long)]
    pub json: bool,
    /// Seed for page contents.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// One sample of one run.
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    /// Simulated time, s.
    pub t: u32,
    /// Saved bytes / allocated bytes.
    pub saved_fraction: f64,
    /// Saved bytes by mechanism.
    pub zero: f64,
    pub sharing: f64,
    pub patching: f64,
    pub compression: f64,
    pub blob_fragmentation: f64,
}

/// One (page type, mechanism) run.
#[derive(Clone, Debug, Serialize)]
pub struct RunResult {
    pub page_type: &'static str,
    pub mechanism: &'static str,
    pub peak: f64,
    pub final_: f64,
    pub samples: Vec<Sample>,
    pub faults: u64,
    /// Peak engine metadata, bytes.
    pub metadata_peak: u64,
}

/// Simulated times of the phase events (1)–(9) of DE Figures 5–7.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Events {
    pub times: [u32; 9],
}

impl Events {
    fn new(a: &MicroArgs) -> Self {
        let (o, p) = (a.op_secs, a.phase_secs);
        let mut t = [0u32; 9];
        for phase in 0..4 {
            t[phase * 2] = phase as u32 * (o + p);
            t[phase * 2 + 1] = t[phase * 2] + o;
        }
        t[8] = t[7] + p;
        Events { times: t }
    }
    /// The last second before the free phase.
    fn final_at(&self) -> u32 {
        self.times[6] - 1
    }
}

struct Pages {
    base_text: Vec<u8>,
    base_random: Vec<u8>,
    seed: u64,
    diff_runs: usize,
}

impl Pages {
    fn new(a: &MicroArgs) -> Self {
        let mut r = SmallRng::seed_from_u64(a.seed);
        let mut base_random = vec![0u8; PAGE_SIZE];
        r.fill(&mut base_random[..]);
        // "Identical" pages: copies of one page of text-like content, which every
        // mechanism can save (DE Fig 5 shows all three saving on identical pages).
        let words: [&[u8]; 8] = [
            b"the ", b"guest ", b"memory ", b"page ", b"is ", b"shared ", b"and ", b"saved\n",
        ];
        let mut base_text = Vec::with_capacity(PAGE_SIZE + 8);
        while base_text.len() < PAGE_SIZE {
            base_text.extend_from_slice(words[r.gen_range(0..8)]);
        }
        base_text.truncate(PAGE_SIZE);
        // 8-byte runs covering `similar_diff_pct` of the page.
        let diff_runs = (PAGE_SIZE * a.similar_diff_pct as usize / 100).div_ceil(8);
        Pages {
            base_text,
            base_random,
            seed: a.seed,
            diff_runs,
        }
    }

    fn page(&self, kind: &str, i: u32) -> Vec<u8> {
        let mut r =
            SmallRng::seed_from_u64(self.seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        match kind {
            "zero" => vec![0u8; PAGE_SIZE],
            "random" => {
                let mut p = vec![0u8; PAGE_SIZE];
                r.fill(&mut p[..]);
                p
            }
            "identical" => self.base_text.clone(),
            _ => {
                let mut p = self.base_random.clone();
                for _ in 0..self.diff_runs {
                    let at = r.gen_range(0..PAGE_SIZE / 8) * 8;
                    r.fill(&mut p[at..at + 8]);
                }
                p
            }
        }
    }
}

/// The 16 fixed offsets the write phase writes one byte to (DE §5.3).
const WRITE_OFFSETS: [usize; 16] = [
    0, 256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2304, 2560, 2816, 3072, 3328, 3584, 3840,
];

fn run_one(
    a: &MicroArgs,
    pages_gen: &Pages,
    kind: &'static str,
    mech: &'static str,
) -> Result<RunResult> {
    let policy = if mech == "all" {
        Policy::difference_engine()
    } else {
        Policy::single(mech).expect("known mechanism")
    };
    let cfg = EngineConfig {
        policy,
        rate: a.scan_rate as u64,
        min_scan_interval_us: 1_000_000,
        max_scan_interval_us: 4_000_000,
        clock_interval_us: Some(a.clock_secs as u64 * 1_000_000),
        ..EngineConfig::default()
    };
    let n = a.pages;
    let mut b = Rig::new(cfg, n + n / 3)?;
    let ev = Events::new(a);
    let per_sec = n.div_ceil(a.op_secs.max(1));
    let mut samples = Vec::new();
    let mut peak: f64 = 0.0;
    let mut final_ = 0.0;
    let mut meta_peak = 0u64;
    let alloc_bytes = n as f64 * PAGE_SIZE as f64;
    let page = PAGE_SIZE as f64;
    for t in 0..=ev.times[8] {
        // The workload's operations for this second.
        for (phase, &start) in [ev.times[0], ev.times[2], ev.times[4], ev.times[6]]
            .iter()
            .enumerate()
        {
            if t >= start && t < start + a.op_secs {
                let from = (t - start) * per_sec;
                for g in from..(from + per_sec).min(n) {
                    let g = Gfn(g);
                    let r = match phase {
                        0 => b.agent.write(g, 0, &pages_gen.page(kind, g.0)),
                        1 => b.agent.read(g).map(|_| ()),
                        2 => WRITE_OFFSETS
                            .iter()
                            .try_for_each(|&off| b.agent.write(g, off, &[0x5A])),
                        // The guest frees the page: zeros, as a balloon or init_on_free
                        // leaves it.
                        _ => b.agent.write(g, 0, &[0u8; PAGE_SIZE]),
                    };
                    r.map_err(anyhow::Error::msg)?;
                }
            }
        }
        b.report();
        for _ in 0..10 {
            b.step(100_000)?;
        }
        let books = b.engine.books();
        let f = books.saved_pages as f64 * page / alloc_bytes;
        peak = peak.max(f);
        meta_peak = meta_peak.max(books.metadata_bytes);
        if t == ev.final_at() {
            final_ = f;
        }
        let s = &books.saved_by;
        samples.push(Sample {
            t,
            saved_fraction: f,
            zero: s.zero as f64 * page,
            sharing: s.sharing as f64 * page,
            patching: s.patching as f64 * page,
            compression: s.compression as f64 * page,
            blob_fragmentation: s.store_waste as f64 * page,
        });
    }
    b.engine
        .check_invariants()
        .map_err(anyhow::Error::msg)
        .context("engine invariants after the run")?;
    let v = &b.engine.books().vms[0].books;
    let faults = v.unstashes + v.refills + v.cow_breaks;
    b.engine.remove(b.vm);
    Ok(RunResult {
        page_type: kind,
        mechanism: mech,
        peak,
        final_,
        samples,
        faults,
        metadata_peak: meta_peak,
    })
}

/// Runs the benchmark and reports.
pub fn run(a: &MicroArgs) -> Result<()> {
    if a.pages == 0 || a.scan_rate == 0 || a.op_secs == 0 {
        bail!("--pages, --scan-rate and --op-secs must be positive");
    }
    if a.similar_diff_pct == 0 || a.similar_diff_pct > 100 {
        bail!("--similar-diff-pct must be in 1..=100");
    }
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| crate::default_out("bench-micro"));
    std::fs::create_dir_all(&out)
        .with_context(|| format!("cannot create output folder {}", out.display()))?;
    let pages_gen = Pages::new(a);
    let jobs: Vec<(&'static str, &'static str)> = PAGE_TYPES
        .iter()
        .flat_map(|&k| MECHANISMS.iter().map(move |&m| (k, m)))
        .collect();
    let next = Mutex::new(0usize);
    let results = Mutex::new(Vec::new());
    let workers = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .min(jobs.len());
    let started = std::time::Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    loop {
                        let i = {
                            let mut n = next.lock().expect("lock");
                            *n += 1;
                            *n - 1
                        };
                        let Some(&(k, m)) = jobs.get(i) else {
                            return Ok(());
                        };
                        let r = run_one(a, &pages_gen, k, m)
                            .with_context(|| format!("{k} pages, {m}"))?;
                        if !a.json {
                            eprintln!(
                                "  {k:>9} / {m:<8} peak {:5.1}%  final {:5.1}%",
                                r.peak * 100.0,
                                r.final_ * 100.0
                            );
                        }
                        results.lock().expect("lock").push(r);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("worker panicked")?;
        }
        Ok(())
    })?;
    let mut results = results.into_inner().expect("lock");
    let order = |r: &RunResult| {
        (
            PAGE_TYPES.iter().position(|&k| k == r.page_type),
            MECHANISMS.iter().position(|&m| m == r.mechanism),
        )
    };
    results.sort_by_key(order);
    let ev = Events::new(a);

    write_csv(&out.join("micro.csv"), &results)?;
    let png = out.join("micro.png");
    let panels: Vec<Panel> = PAGE_TYPES
        .iter()
        .map(|&k| Panel {
            title: format!("{k} pages"),
            series: results
                .iter()
                .filter(|r| r.page_type == k)
                .map(|r| Series {
                    name: r.mechanism.to_string(),
                    points: r
                        .samples
                        .iter()
                        .map(|s| (s.t as f64, s.saved_fraction * 100.0))
                        .collect(),
                })
                .collect(),
            markers: ev.times.iter().map(|&t| t as f64).collect(),
        })
        .collect();
    plot::panels(
        &png,
        "memfold bench micro (DE §5.3): savings over time",
        "simulated time (s)",
        "saved (% of allocated)",
        &panels,
    )?;

    if a.json {
        let mut savings = serde_json::Map::new();
        for &k in &PAGE_TYPES {
            let mut per = serde_json::Map::new();
            for r in results.iter().filter(|r| r.page_type == k) {
                per.insert(
                    r.mechanism.into(),
                    serde_json::json!({
                        "peak": r.peak,
                        "final": r.final_,
                        "faults": r.faults,
                        "metadata_peak_bytes": r.metadata_peak,
                    }),
                );
            }
            savings.insert(k.into(), per.into());
        }
        let doc = serde_json::json!({
            "benchmark": "micro",
            "pages": a.pages,
            "scan_rate": a.scan_rate,
            "phase_secs": a.phase_secs,
            "clock_secs": a.clock_secs,
            "events_s": ev.times,
            "savings": savings,
            "metadata_peak_bytes": results.iter().map(|r| r.metadata_peak).max(),
            "csv": out.join("micro.csv"),
            "png": png,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print_over_time(&results, &ev);
        println!("\nSavings as a fraction of allocated memory ({} pages of 4 KiB, scan rate {} pages/s, {} s phases):", a.pages, a.scan_rate, a.phase_secs);
        println!(
            "{:<10} {}",
            "pages",
            MECHANISMS
                .iter()
                .map(|m| format!("{:>20}", format!("{m} peak/final")))
                .collect::<String>()
        );
        for &k in &PAGE_TYPES {
            let cells: String = MECHANISMS
                .iter()
                .map(|&m| {
                    let r = find(&results, k, m);
                    format!(
                        "{:>20}",
                        format!("{:.1}% / {:.1}%", r.peak * 100.0, r.final_ * 100.0)
                    )
                })
                .collect();
            println!("{k:<10} {cells}");
        }
        let worst = results
            .iter()
            .max_by_key(|r| r.metadata_peak)
            .expect("runs");
        let managed = (a.pages + a.pages / 3) as f64 * PAGE_SIZE as f64;
        println!(
            "\nengine metadata, peak: {} bytes, {:.3}% of managed memory ({} / {})",
            worst.metadata_peak,
            worst.metadata_peak as f64 / managed * 100.0,
            worst.page_type,
            worst.mechanism
        );
        println!(
            "time series: {}\nplot: {}\n({:.1} s)",
            out.join("micro.csv").display(),
            png.display(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// The run of one page type and mechanism (every pair is run).
fn find<'a>(results: &'a [RunResult], page_type: &str, mechanism: &str) -> &'a RunResult {
    results
        .iter()
        .find(|r| r.page_type == page_type && r.mechanism == mechanism)
        .expect("every pair is run")
}

/// Savings at each phase event, a table per page type (DE Figures 5–7 as numbers).
fn print_over_time(results: &[RunResult], ev: &Events) {
    const NAMES: [&str; 9] = [
        "alloc",
        "alloc end",
        "read",
        "read end",
        "write",
        "write end",
        "free",
        "free end",
        "end",
    ];
    for &k in &PAGE_TYPES {
        println!("\n{k} pages: saved (% of allocated) at each event");
        println!(
            "{:>4} {:<10} {}",
            "t(s)",
            "event",
            MECHANISMS
                .iter()
                .map(|m| format!("{m:>9}"))
                .collect::<String>()
        );
        for (i, &t) in ev.times.iter().enumerate() {
            // The sample just before the event: the state the previous phase left.
            let at = t.saturating_sub(1);
            let cells: String = MECHANISMS
                .iter()
                .map(|&m| {
                    let r = find(results, k, m);
                    format!("{:>8.1}%", r.samples[at as usize].saved_fraction * 100.0)
                })
                .collect();
            println!("{t:>4} {:<10} {cells}", NAMES[i]);
        }
    }
}

fn write_csv(path: &std::path::Path, results: &[RunResult]) -> Result<()> {
    use std::io::Write;
    let mut f = crate::create_output(path)?;
    writeln!(f, "page_type,mechanism,t_s,saved_fraction,zero_bytes,sharing_bytes,patching_bytes,compression_bytes,blob_fragmentation_bytes")?;
    for r in results {
        for s in &r.samples {
            writeln!(
                f,
                "{},{},{},{:.6},{:.0},{:.0},{:.0},{:.0},{:.0}",
                r.page_type,
                r.mechanism,
                s.t,
                s.saved_fraction,
                s.zero,
                s.sharing,
                s.patching,
                s.compression,
                s.blob_fragmentation
            )?;
        }
    }
    Ok(())
}
