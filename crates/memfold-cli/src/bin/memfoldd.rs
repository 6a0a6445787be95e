//! memfoldd: the memfold daemon. Guests attach through the agent preloaded into QEMU;
//! memfoldd runs the engine over them: sharing, zero pages, the Difference Engine's
//! patching and compression of cold pages, and swap over a host budget.

use std::path::PathBuf;

use clap::Parser;
use memfold_cli::engine_args::EngineArgs;
use memfold_live::daemon::{run, DaemonConfig};
use memfold_live::metrics::MetricsServer;

/// memfoldd: saves the host memory of running QEMU guests (see `memfold run`).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Socket for agents and clients.
    #[arg(long, default_value = "/run/memfold/memfoldd.sock")]
    socket: PathBuf,
    /// The engine's settings.
    #[command(flatten)]
    engine: EngineArgs,
    /// Folder for the guests' swap files (with --host-budget-mib): one per guest, unnamed
    /// (`O_TMPFILE`, mode 0600). It belongs on a disk: on tmpfs, swapped pages would still
    /// be host memory.
    #[arg(long, default_value = "/var/tmp")]
    swap_dir: PathBuf,
    /// A group whose members' QEMUs may attach (the socket becomes mode 0660, that
    /// group's): QEMUs run as a user per tenant, each user its own sharing domain under
    /// `--share-domains user`. They may attach and read statistics; only root and
    /// memfoldd's user may opt a guest out.
    #[arg(long, value_name = "GID")]
    agent_gid: Option<u32>,
    /// Serve Prometheus metrics (`GET /metrics`) at this address, e.g. 127.0.0.1:9464
    /// (default: none). Loopback only unless --metrics-allow-remote.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Allow --metrics-listen on a non-loopback address (the metrics name every guest).
    #[arg(long, requires = "metrics_listen")]
    metrics_allow_remote: bool,
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let a = Args::parse();
    let engine = match a.engine.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("memfoldd: {e}");
            std::process::exit(2);
        }
    };
    if let Some(dir) = a.socket.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    // The endpoint asks this memfoldd for its statistics over the socket, per scrape.
    let _metrics = match a.metrics_listen {
        Some(addr) => match MetricsServer::start(addr, a.metrics_allow_remote, a.socket.clone()) {
            Ok(m) => Some(m),
            Err(e) => {
                eprintln!("memfoldd: {e}");
                std::process::exit(2);
            }
        },
        None => None,
    };
    let cfg = DaemonConfig {
        socket: a.socket,
        engine,
        swap_dir: a.swap_dir,
        swap_capacity: a.engine.swap_mib << 20,
        domains: a.engine.domain_rule(),
        agent_gid: a.agent_gid,
        claim: a.engine.claim(),
        allowance: a.engine.allowance_mib << 20,
    };
    if let Err(e) = run(cfg) {
        tracing::error!("{e}");
        std::process::exit(1);
    }
}
