//! `memfold capture`: boot a guest set and snapshot its RAM.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use memfold_vm::capture::{capture, CaptureInfo};
use memfold_vm::launcher::{Guest, RamBackend};

use crate::guests;

/// Arguments of `memfold capture`.
#[derive(Args, Clone, Debug)]
pub struct CaptureArgs {
    /// Guest profiles, comma-separated.
    #[arg(long, default_value = "tiny")]
    pub profiles: String,
    /// Guest RAM backing: memfd (what memfold manages) or anonymous (what KSM scans).
    #[arg(long, default_value = "memfd")]
    pub ram: String,
    /// Seconds to let the guests run after they are ready.
    #[arg(long, default_value_t = 10)]
    pub settle: u64,
    /// RAM per guest, MiB (default: the profile's).
    #[arg(long)]
    pub mem_mib: Option<u32>,
    /// Capture without pausing the guests (the snapshot may be slightly inconsistent).
    #[arg(long)]
    pub live: bool,
    /// Output folder for the snapshots.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Parses a RAM backing name.
pub fn ram_backend(s: &str) -> Result<RamBackend> {
    match s {
        "memfd" => Ok(RamBackend::Memfd),
        "anonymous" | "anon" => Ok(RamBackend::Anonymous),
        _ => anyhow::bail!("unknown RAM backing '{s}' (memfd, anonymous)"),
    }
}

/// Captures every guest into `out`, printing a line each.
pub fn capture_all(
    guests: &[Guest],
    out: &std::path::Path,
    pause: bool,
) -> Result<Vec<CaptureInfo>> {
    let mut infos = Vec::new();
    for g in guests {
        let i = capture(g, out, pause)?;
        eprintln!(
            "  captured {}: {} pages, {} resident ({:.0}%), paused {} ms, {} ms in all -> {}",
            i.name,
            i.pages,
            i.resident_pages,
            100.0 * i.resident_pages as f64 / i.pages as f64,
            i.paused_ms,
            i.ms,
            i.ram.display()
        );
        infos.push(i);
    }
    Ok(infos)
}

/// `memfold capture`.
pub fn run(a: &CaptureArgs) -> Result<()> {
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| crate::default_out("capture"));
    let cache = memfold_vm::images::cache_dir();
    let specs = guests::specs(&a.profiles, ram_backend(&a.ram)?, a.mem_mib)?;
    guests::ensure_images(&cache, &specs)?;
    let (gs, _) = guests::boot(
        &cache,
        &specs,
        &guests::workdir(&out)?,
        Duration::from_secs(600),
        |_| Vec::new(),
    )?;
    std::thread::sleep(Duration::from_secs(a.settle));
    let infos = capture_all(&gs, &out, !a.live)?;
    drop(gs);
    for i in infos {
        println!("{}", i.ram.display());
    }
    Ok(())
}
