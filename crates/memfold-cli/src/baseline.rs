//! `memfold baseline`: the static baseline (the main job before live sharing; `memfold run`
//! is now). Builds any missing image, boots a mixed guest set (two Debian releases) on
//! anonymous RAM, analyses its RAM statically with the engine's detectors and codecs (DE
//! Table 1), measures Linux KSM (aggressive) on the very same guests, and prints the
//! comparison.

use anyhow::Result;
use clap::Args;
use memfold_core::analysis::{AnalysisConfig, SetAnalysis};
use memfold_sys::ksm::{Ksm, KsmMode};
use memfold_vm::launcher::RamBackend;

use crate::run::measure::MIB;
use crate::{analyze, capture, guests, ksm};

/// Arguments of `memfold baseline`.
#[derive(Args, Clone, Debug)]
pub struct BaselineArgs {
    /// The guests.
    #[command(flatten)]
    pub set: guests::GuestSetArgs,
    /// Seconds KSM (aggressive) runs.
    #[arg(long, default_value_t = 90)]
    pub ksm_secs: u64,
}

/// `memfold baseline`.
pub fn run(a: &BaselineArgs) -> Result<()> {
    // KSM stopped and unmerged before the guests start: nothing is merged until we say so.
    let ksm_ctl = Ksm::take_control()?;
    ksm_ctl.unmerge()?;
    let (mut gs, accel, out) = guests::start_set(&a.set, RamBackend::Anonymous, "baseline")?;

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
    let run = ksm::run_mode(
        &ksm_ctl,
        &mut gs,
        KsmMode::AGGRESSIVE,
        a.ksm_secs,
        None,
        None,
    )?;
    drop(ksm_ctl);
    ksm::write_outputs(&out, std::slice::from_ref(&run))?;
    let mismatches = crate::run::mismatches(gs.iter());
    drop(gs);

    let all = sets
        .iter()
        .find(|s| s.name == "all" && s.basis == "resident")
        .or_else(|| sets.iter().find(|s| s.basis == "resident"))
        .expect("a set");
    let cmp = Comparison::new(all, &run);
    std::fs::write(
        out.join("analysis.json"),
        serde_json::to_string_pretty(&sets)?,
    )?;
    if a.set.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "guests": a.set.profiles, "accel": format!("{accel:?}"),
                "comparison": cmp, "ksm_t95_s": run.t95_s, "guest_mismatches": mismatches, "sets": sets,
            }))?
        );
    } else {
        println!();
        analyze::print_table(&sets);
        cmp.print(all, &run);
        println!("guest self-check mismatches: {}", mismatches.len());
        println!("outputs: {}", out.display());
    }
    // A guest's memory read wrong: the outputs are written, and the command fails.
    let failures = crate::run::measure::mismatch_failures(&mismatches);
    crate::run::ensure_clean("memfold baseline", &failures, &out)
}

/// Static analysis against KSM on the same guests, bytes. KSM's `pages_sharing` counts
/// merged identical pages; its measured saving (host memory, `memfold_vm::hostmem`) also
/// includes zero-filled pieces of huge pages it split, which the kernel maps to the zero
/// page. So identical non-zero pages are compared with `pages_sharing`, and resident zero
/// pages with the rest of KSM's measured saving.
#[derive(serde::Serialize)]
struct Comparison {
    static_sharing_saved_bytes: f64,
    static_patching_saved_bytes: f64,
    static_compression_saved_bytes: f64,
    static_nonzero_identical_saved_bytes: f64,
    static_resident_zero_bytes: f64,
    ksm_saved_bytes: f64,
    ksm_pages_sharing_bytes: f64,
    ksm_zero_and_split_bytes: f64,
    nonzero_identical_vs_pages_sharing: f64,
    static_sharing_vs_ksm: f64,
}

impl Comparison {
    fn new(all: &SetAnalysis, run: &ksm::KsmRun) -> Self {
        let saved = |pages: f64| (all.pages as f64 - pages) * 4096.0;
        let rel = |a: f64, b: f64| if b > 0.0 { (a - b) / b } else { f64::NAN };
        let nonzero = (all.duplicate_pages - all.distinct_duplicate_pages) as f64 * 4096.0;
        let sharing = saved(all.pages_sharing_only);
        Comparison {
            static_sharing_saved_bytes: sharing,
            static_patching_saved_bytes: saved(all.pages_with_patching),
            static_compression_saved_bytes: saved(all.pages_with_compression),
            static_nonzero_identical_saved_bytes: nonzero,
            static_resident_zero_bytes: all.zero_pages as f64 * 4096.0,
            ksm_saved_bytes: run.saved_bytes,
            ksm_pages_sharing_bytes: run.ksm_sharing_bytes,
            // Gross of KSM's rmap items, as pages_sharing is.
            ksm_zero_and_split_bytes: run.saved_bytes + run.own_bytes - run.ksm_sharing_bytes,
            nonzero_identical_vs_pages_sharing: rel(nonzero, run.ksm_sharing_bytes),
            static_sharing_vs_ksm: rel(sharing, run.saved_bytes + run.own_bytes),
        }
    }

    fn print(&self, all: &SetAnalysis, run: &ksm::KsmRun) {
        let mib = |b: f64| b / MIB;
        println!(
            "\nHost-resident guest RAM at capture: {:.1} MiB ({} pages) in {} guests",
            mib(all.pages as f64 * 4096.0),
            all.pages,
            all.guests.len()
        );
        println!(
            "  static, sharing only:               saves {:7.1} MiB",
            mib(self.static_sharing_saved_bytes)
        );
        println!(
            "  static, sharing + patching:         saves {:7.1} MiB",
            mib(self.static_patching_saved_bytes)
        );
        println!(
            "  static, + compression:              saves {:7.1} MiB",
            mib(self.static_compression_saved_bytes)
        );
        println!(
            "  Linux KSM (aggressive), measured:   saves {:7.1} MiB, 95% of plateau after {}",
            mib(self.ksm_saved_bytes),
            run.t95_s.map_or("-".into(), |t| format!("{t:.0} s"))
        );
        println!(
            "  identical non-zero pages: static {:.1} MiB, KSM pages_sharing {:.1} MiB ({:+.1}%)",
            mib(self.static_nonzero_identical_saved_bytes),
            mib(self.ksm_pages_sharing_bytes),
            self.nonzero_identical_vs_pages_sharing * 100.0
        );
        println!(
            "  zero pages: {:.1} MiB resident; KSM's saving beyond pages_sharing (zero pieces of split huge pages) {:.1} MiB",
            mib(self.static_resident_zero_bytes),
            mib(self.ksm_zero_and_split_bytes)
        );
        println!(
            "  static sharing-only vs KSM measured: {:+.1}%",
            self.static_sharing_vs_ksm * 100.0
        );
    }
}
