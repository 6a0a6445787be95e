//! memfoldd: the memfold daemon. Guests attach through the agent preloaded into QEMU.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use memfold_core::{CompressCodec, PatchCodec, Policy};
use memfold_live::daemon::{run, DaemonConfig, ZeroPolicy};

/// memfoldd: shares identical pages of running QEMU guests (see `memfold run`).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Socket for agents and clients.
    #[arg(long, default_value = "/run/memfold/memfoldd.sock")]
    socket: PathBuf,
    /// Scan rate limit, pages/s (0: full speed).
    #[arg(long, default_value_t = 100_000)]
    rate: u64,
    /// Zero pages: reclaim (punch out, refill on access), share (one zero frame, ESX) or
    /// keep (Satori §4.1).
    #[arg(long, value_enum, default_value_t = ZeroPolicy::Reclaim)]
    zero: ZeroPolicy,
    /// Shortest time between the starts of two full scans, ms.
    #[arg(long, default_value_t = 1000)]
    min_scan_interval_ms: u64,
    /// Longest time between full scans, ms (quiet scans back off up to this).
    #[arg(long, default_value_t = 8000)]
    max_scan_interval_ms: u64,
    /// NRU clock: ms for the hand to pass over each guest once (DE §4.2 uses ≥ 4000);
    /// 0 turns the clock and its R/M tracking faults off.
    #[arg(long, default_value_t = 0)]
    clock_interval_ms: u64,
    /// Which mechanisms may touch pages of each NRU class (DE §4.2): `sharing` (ESX/KSM),
    /// `de` (the Difference Engine: sharing, patching, compression), `aggressive`, or one
    /// mechanism alone. Patching and compression need the clock (--clock-interval-ms).
    #[arg(long, default_value = "sharing", value_parser = clap::builder::PossibleValuesParser::new(Policy::NAMES))]
    policy: String,
    /// Patch encoding (DE §3.2).
    #[arg(long, default_value = "run-diff")]
    patch_codec: PatchCodec,
    /// Largest patch kept, bytes.
    #[arg(long, default_value_t = 2048)]
    patch_cutoff: usize,
    /// Page compressor (DE §3.3): zstd level 1 saves more than LZ4 on real guests
    /// (docs/live-de.md) for a few µs more per compress and decode.
    #[arg(long, default_value = "zstd")]
    compress_codec: CompressCodec,
    /// Largest compressed page kept, bytes.
    #[arg(long, default_value_t = 2048)]
    compress_cutoff: usize,
    /// Host memory budget for the guests' RAM, MiB (their memfds, the pool and the
    /// store); over it, cold (C4) pages are swapped out (DE §4.6). Needs the clock.
    #[arg(long)]
    host_budget_mib: Option<u64>,
    /// Swap file to create (unlinked once open; default: /var/tmp/memfoldd-swap-PID). It
    /// belongs on a disk: on tmpfs, swapped pages would still be host memory.
    #[arg(long)]
    swap_file: Option<PathBuf>,
    /// Swap file capacity, MiB.
    #[arg(long, default_value_t = 1024)]
    swap_mib: u64,
}

fn main() {
    let a = Args::parse();
    if let Some(dir) = a.socket.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let swap_file = a
        .swap_file
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("/var/tmp/memfoldd-swap-{}", std::process::id())));
    let policy = Policy::by_name(&a.policy).expect("clap checked the name");
    let cfg = DaemonConfig {
        socket: a.socket,
        rate: a.rate,
        zero: a.zero,
        min_scan_interval: Duration::from_millis(a.min_scan_interval_ms),
        max_scan_interval: Duration::from_millis(
            a.max_scan_interval_ms.max(a.min_scan_interval_ms),
        ),
        clock_interval: (a.clock_interval_ms > 0)
            .then(|| Duration::from_millis(a.clock_interval_ms)),
        policy,
        patch_codec: a.patch_codec,
        patch_cutoff: a.patch_cutoff.min(4096),
        compress_codec: a.compress_codec,
        compress_cutoff: a.compress_cutoff.min(4096),
        host_budget: a.host_budget_mib.map(|m| m << 20),
        swap_file,
        swap_capacity: a.swap_mib << 20,
    };
    if a.clock_interval_ms == 0 && policy.needs_clock() {
        eprintln!("memfoldd: policy {} patches or compresses only pages the NRU clock finds cold: give --clock-interval-ms (e.g. 4000)", a.policy);
        std::process::exit(2);
    }
    if a.host_budget_mib.is_some() && a.clock_interval_ms == 0 {
        eprintln!("memfoldd: --host-budget-mib swaps out pages the NRU clock finds cold: give --clock-interval-ms (e.g. 4000)");
        std::process::exit(2);
    }
    if let Err(e) = run(cfg) {
        eprintln!("memfoldd: error: {e}");
        std::process::exit(1);
    }
}
