//! `memfold compare`: the same guest set under memfold (`--policy`: the Difference Engine,
//! `de`, by default, or `sharing`, ...) and under Linux KSM (aggressive settings), one
//! after the other on fresh boots, measured the same way (`memfold_vm::hostmem`): host
//! memory saved, time to 95% of the plateau, CPU seconds.

use anyhow::Result;
use clap::Args;
use memfold_sys::ksm::{Ksm, KsmMode};
use memfold_vm::launcher::RamBackend;

use crate::guests;
use crate::ksm::run_mode;
use crate::run::measure::{t95_text, MIB};
use crate::run::{self, cpu_seconds, MemfoldArgs, RunArgs};

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
}

/// Huge pages on the KSM side of `memfold compare`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KsmThp {
    /// As the host's THP setting says.
    Host,
    /// Off for the guests' QEMUs (PR_SET_THP_DISABLE).
    Off,
}

/// ksmd's pid (a kernel thread), if KSM is built in.
fn ksmd_pid() -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        (std::fs::read_to_string(e.path().join("comm")).ok()?.trim() == "ksmd").then_some(pid)
    })
}

/// `memfold compare`.
pub fn run(a: &CompareArgs) -> Result<()> {
    let stop = run::ctrl_c_flag()?;
    anyhow::ensure!(
        a.memfold.secs > 0,
        "memfold compare needs --secs > 0 (each side runs that long)"
    );
    // KSM's controls are checked before the memfold half runs, not after it.
    anyhow::ensure!(
        std::path::Path::new("/sys/kernel/mm/ksm/run").exists(),
        "/sys/kernel/mm/ksm is missing: this kernel has no KSM (CONFIG_KSM), so compare has no peer to measure"
    );
    eprintln!("== memfold (policy {}) on the set", a.memfold.engine.policy);
    let (m, out) = run::measure(&RunArgs::without_twins(a.memfold.clone()), "compare", &stop)?;
    run::write_outputs(&out, &m)?;

    eprintln!("== Linux KSM (aggressive) on the same set, booted afresh");
    let ksm = Ksm::take_control()?;
    ksm.unmerge()?;
    let mut set = a.memfold.set.clone();
    set.out = Some(out.join("ksm"));
    let backend = match a.ksm_thp {
        KsmThp::Host => RamBackend::Anonymous,
        KsmThp::Off => RamBackend::AnonymousNoThp,
    };
    let (mut gs, _accel, kout) = guests::start_set(&set, backend, "compare")?;
    let kpid = ksmd_pid();
    let cpu0 = kpid.map_or(0.0, |p| cpu_seconds(p, None));
    let k = run_mode(&ksm, &mut gs, KsmMode::AGGRESSIVE, a.memfold.secs)?;
    let ksm_cpu_s = kpid.map_or(0.0, |p| cpu_seconds(p, None)) - cpu0;
    ksm.unmerge()?;
    drop(ksm);
    crate::ksm::write_outputs(&kout, std::slice::from_ref(&k))?;
    let mismatches: Vec<String> = gs.iter().flat_map(|g| g.mismatches()).collect();
    drop(gs);
    let j = serde_json::json!({
        "guests": a.memfold.set.profiles,
        "secs": a.memfold.secs,
        "ksm_thp": a.ksm_thp,
        "memfold_used_before_bytes": m.used_before,
        "ksm_used_before_bytes": k.used_before,
        "memfold_saved_bytes": m.saved_bytes,
        "ksm_saved_bytes": k.saved_bytes,
        // Where each side ends: anonymous THP-backed RAM (KSM) starts higher than memfd RAM.
        "memfold_used_after_bytes": m.used_before as f64 - m.saved_bytes,
        "ksm_used_after_bytes": k.used_before as f64 - k.saved_bytes,
        "memfold_books_saved_bytes": m.books_saved_bytes,
        "ksm_pages_sharing_bytes": k.ksm_sharing_bytes,
        "memfold_t95_s": m.t95_s,
        "ksm_t95_s": k.t95_s,
        "memfold_cpu_s": m.cpu_s,
        "memfold_daemon_restarts": m.daemon_restarts,
        "ksm_cpu_s": ksm_cpu_s,
        "ksm_guest_mismatches": mismatches.len(),
        "memfold_zero_policy": a.memfold.engine.zero,
        "memfold_policy": a.memfold.engine.policy,
        "memfold_saved_by_pages": m.end().map(|s| s.saved_by),
        "memfold_lifetime": m.end().map(|s| s.lifetime.clone()),
        "memfold_latency_us": m.end().map(|s| s.latency),
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
    }
    Ok(())
}
