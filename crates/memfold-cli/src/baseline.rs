//! `memfold baseline`: the main job until live sharing lands. Builds the default images,
//! boots a mixed guest set (two Debian releases), analyses its RAM statically with the
//! engine's detectors and codecs (DE Table 1), measures Linux KSM on the very same guests,
//! and prints the comparison.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use memfold_core::analysis::{AnalysisConfig, SetAnalysis};
use memfold_mem::ksm::{Ksm, KsmMode};
use memfold_vm::launcher::RamBackend;

use crate::{analyze, capture, guests, ksm};

/// Arguments of `memfold baseline`.
#[derive(Args, Clone, Debug)]
pub struct BaselineArgs {
    /// Guest profiles, comma-separated.
    #[arg(long, default_value = "web,web,db,py-trixie")]
    pub profiles: String,
    /// Seconds to let the guests run after they are ready.
    #[arg(long, default_value_t = 30)]
    pub settle: u64,
    /// Seconds KSM (aggressive) runs.
    #[arg(long, default_value_t = 90)]
    pub ksm_secs: u64,
    /// RAM per guest, MiB (default: the profile's).
    #[arg(long)]
    pub mem_mib: Option<u32>,
    /// Output folder.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `memfold baseline`.
pub fn run(a: &BaselineArgs) -> Result<()> {
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| crate::default_out("baseline"));
    let cache = memfold_vm::images::cache_dir();
    let specs = guests::specs(&a.profiles, RamBackend::Anonymous, a.mem_mib)?;
    eprintln!("images ({}):", cache.display());
    guests::ensure_images(&cache, &specs)?;
    let ksm_ctl = Ksm::take_control()?;
    ksm_ctl.unmerge()?;
    let (mut gs, accel) = guests::boot(
        &cache,
        &specs,
        &guests::workdir(&out)?,
        Duration::from_secs(600),
    )?;
    eprintln!("settling {} s", a.settle);
    std::thread::sleep(Duration::from_secs(a.settle));

    eprintln!("capturing RAM (guests paused one at a time)");
    let snaps = out.join("snapshots");
    let infos = capture::capture_all(&gs, &snaps, true)?;
    let loaded: Vec<analyze::Loaded> = infos
        .iter()
        .map(|i| analyze::load(&i.ram))
        .collect::<Result<_>>()?;
    let t = std::time::Instant::now();
    let sets = analyze::run_on(&loaded, &AnalysisConfig::default())?;
    let bytes: u64 = loaded.iter().map(|l| l.ram.len() as u64).sum();
    eprintln!(
        "analysed {:.2} GiB in {:.2} s",
        bytes as f64 / (1u64 << 30) as f64,
        t.elapsed().as_secs_f64()
    );
    analyze::chart(&out.join("analysis.png"), &sets)?;
    drop(loaded);

    eprintln!("KSM, aggressive settings, {} s", a.ksm_secs);
    let run = ksm::run_mode(&ksm_ctl, &mut gs, KsmMode::AGGRESSIVE, a.ksm_secs)?;
    drop(ksm_ctl);
    ksm::write_outputs(&out, std::slice::from_ref(&run))?;
    let mismatches: Vec<String> = gs.iter().flat_map(|g| g.mismatches()).collect();
    drop(gs);

    let all = sets
        .iter()
        .find(|s| s.name == "all" && s.basis == "resident")
        .or_else(|| sets.iter().find(|s| s.basis == "resident"))
        .expect("a set");
    let saved = |pages: f64| (all.pages as f64 - pages) * 4096.0;
    let static_sharing = saved(all.pages_sharing_only);
    let diff = if run.saved_bytes > 0.0 {
        (static_sharing - run.saved_bytes) / run.saved_bytes
    } else {
        f64::NAN
    };
    std::fs::write(
        out.join("analysis.json"),
        serde_json::to_string_pretty(&sets)?,
    )?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "guests": a.profiles, "accel": format!("{accel:?}"),
                "static_sharing_saved_bytes": static_sharing,
                "static_patching_saved_bytes": saved(all.pages_with_patching),
                "static_compression_saved_bytes": saved(all.pages_with_compression),
                "ksm_saved_bytes": run.saved_bytes, "ksm_pages_sharing_bytes": run.ksm_sharing_bytes, "ksm_t95_s": run.t95_s,
                "static_vs_ksm": diff, "guest_mismatches": mismatches, "sets": sets,
            }))?
        );
        return Ok(());
    }
    println!();
    analyze::print_table(&sets);
    print_comparison(all, static_sharing, &run, diff);
    println!("guest self-check mismatches: {}", mismatches.len());
    println!("outputs: {}", out.display());
    Ok(())
}

fn print_comparison(all: &SetAnalysis, static_sharing: f64, run: &ksm::KsmRun, diff: f64) {
    let mib = |b: f64| b / 1048576.0;
    let saved = |pages: f64| (all.pages as f64 - pages) * 4096.0;
    println!(
        "\nHost-resident guest RAM: {:.1} MiB ({} pages) in {} guests",
        mib(all.pages as f64 * 4096.0),
        all.pages,
        all.guests.len()
    );
    println!(
        "  static, sharing only:              saves {:7.1} MiB",
        mib(static_sharing)
    );
    println!(
        "  static, sharing + patching:        saves {:7.1} MiB",
        mib(saved(all.pages_with_patching))
    );
    println!(
        "  static, + compression:             saves {:7.1} MiB",
        mib(saved(all.pages_with_compression))
    );
    println!(
        "  Linux KSM (aggressive), measured:  saves {:7.1} MiB (pages_sharing {:.1} MiB), 95% of plateau after {}",
        mib(run.saved_bytes),
        mib(run.ksm_sharing_bytes),
        run.t95_s.map_or("-".into(), |t| format!("{t:.0} s"))
    );
    println!("  static sharing vs KSM: {:+.1}%", diff * 100.0);
}
