//! The KSM side of `memfold compare` (`--peer ksm`, `ksm+fpr`) and of `bench scale`:
//! the set booted afresh on anonymous RAM and run under KSM (aggressive), measured as
//! memfold's side is.

use std::sync::atomic::AtomicBool;

use anyhow::Result;
use memfold_sys::ksm::{Ksm, KsmMode};

use super::KsmThp;
use crate::guests;
use crate::ksm::run_mode;
use crate::run::measure::{kernel_threads_cpu_seconds, start_marks, throughput, Throughput};
use crate::run::{self, Twins};

/// The KSM side of a compare, measured.
pub struct KsmSide {
    /// Its run: host memory before and saved, time to 95%, the samples.
    pub run: crate::ksm::KsmRun,
    /// ksmd's CPU seconds over the run, and the censuses' (`--census`, run in this
    /// process: [`crate::ksm::KsmRun::census_cpu_s`]), as memfold's CPU holds memfoldd's.
    pub cpu_s: f64,
    /// Each workload's throughput against its plain twin (empty without twins).
    pub throughput: Vec<Throughput>,
    /// Self-check mismatches the guests reported (managed and plain), `guest: line`.
    pub mismatches: Vec<String>,
}

impl KsmSide {
    /// What fails the compare (after its outputs): a self-check mismatch, an early stop.
    pub fn failures(&self) -> Vec<String> {
        let mut f = crate::run::measure::mismatch_failures(&self.mismatches);
        if self.run.interrupted {
            f.push("interrupted (Ctrl-C or SIGTERM) before its --secs".into());
        }
        f
    }

    /// Why the side is marked: its failures and the workloads it did not measure.
    pub fn marks(&self) -> Vec<String> {
        let mut m = self.failures();
        m.extend(crate::run::measure::unmeasured(&self.throughput));
        m
    }
}

/// Boots `set` afresh (anonymous RAM, huge pages as `thp` says; with `twins`, a plain
/// twin beside each guest, its RAM not mergeable; with `fpr`, a virtio balloon with free
/// page reporting in each managed guest, checked to report) and runs KSM aggressive on it for
/// `secs` (or until `stop` is set), with a census of the guests' memory every `census`
/// seconds (if any), its files under `out/ksm`. KSM is unmerged before and after.
///
/// Errors: KSM cannot be driven, a guest fails to boot or dies.
#[allow(clippy::too_many_arguments)]
pub fn ksm_side(
    set: &guests::GuestSetArgs,
    twins: Option<Twins>,
    thp: KsmThp,
    fpr: bool,
    secs: u64,
    census: Option<u64>,
    out: &std::path::Path,
    stop: Option<&AtomicBool>,
) -> Result<KsmSide> {
    let ksm = Ksm::take_control()?;
    ksm.unmerge()?;
    let mut set = set.clone();
    set.out = Some(out.join("ksm"));
    // The plain twins' RAM is not mergeable: KSM leaves them alone.
    let (mut gs, mut plain, kout) = guests::start_pairs(
        &set,
        twins,
        thp.backend(),
        "compare",
        |s, managed| {
            s.mem_merge = managed;
            s.free_page_reporting = managed && fpr;
        },
        |_| Vec::new(),
    )?;
    if fpr {
        crate::peer::check_reporting(&gs)?;
    }
    let since = start_marks(gs.iter().chain(&plain));
    let cpu0 = kernel_threads_cpu_seconds(&["ksmd"]);
    let k = run_mode(&ksm, &mut gs, KsmMode::AGGRESSIVE, secs, census, stop)?;
    let cpu_s = kernel_threads_cpu_seconds(&["ksmd"]) - cpu0 + k.census_cpu_s;
    let throughput = throughput(&gs, &plain, &since);
    ksm.unmerge()?;
    drop(ksm);
    crate::ksm::write_outputs(&kout, std::slice::from_ref(&k))?;
    let mismatches = run::mismatches(gs.iter().chain(&plain));
    for g in plain.iter_mut() {
        g.check_alive()?;
    }
    Ok(KsmSide {
        run: k,
        cpu_s,
        throughput,
        mismatches,
    })
}
