//! memfoldd: the memfold daemon. Guests attach through the agent preloaded into QEMU.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
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
}

fn main() {
    let a = Args::parse();
    if let Some(dir) = a.socket.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
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
    };
    if let Err(e) = run(cfg) {
        eprintln!("memfoldd: error: {e}");
        std::process::exit(1);
    }
}
