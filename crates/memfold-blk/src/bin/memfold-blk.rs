//! `memfold-blk`: one guest disk served over vhost-user-blk (see the crate's docs: one
//! process per disk, guest RAM reached only through QEMU's page tables).
//!
//! ```text
//! memfold-blk --socket /run/g1-data.sock --serial memfold-data --base data.img
//! memfold-blk --socket /run/g1-root.sock --serial root --base web.raw --overlay g1.qcow2
//! ```
//! QEMU attaches it with `-chardev socket,id=X,path=SOCK,reconnect=1 -device
//! vhost-user-blk-pci,chardev=X` (guest RAM `memory-backend-memfd,share=on`). It serves
//! one connection at a time and waits for the next when QEMU disconnects (QEMU's
//! `reconnect` brings it back after a restart of either side); with `--qemu-pid` it
//! refuses any other peer and exits once that QEMU has exited.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use clap::Parser;
use memfold_blk::blk::{BlkBackend, BlkConfig};
use memfold_blk::disk::{Disk, OverlayDisk, RawDisk};
use memfold_blk::landed::{CountingSink, LandedSink, LogSink};
use vhost_user_backend::VhostUserDaemon;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

/// Command line.
#[derive(Parser, Debug)]
#[command(
    name = "memfold-blk",
    about = "memfold's sharing-aware block device (vhost-user-blk), one disk"
)]
struct Args {
    /// The vhost-user socket to listen on.
    #[arg(long)]
    socket: PathBuf,
    /// The raw image: the whole disk (read-only) or, with --overlay, its read-only base.
    #[arg(long)]
    base: PathBuf,
    /// A qcow2 overlay over --base (`qemu-img create -f qcow2 -b BASE -F raw OVERLAY`):
    /// the disk is then writable, writes go to the overlay.
    #[arg(long)]
    overlay: Option<PathBuf>,
    /// The serial get-id answers (the tiny image finds its data disk by `memfold-data`).
    #[arg(long, default_value = "memfold-blk")]
    serial: String,
    /// Queues offered.
    #[arg(long, default_value_t = 1)]
    queues: u16,
    /// The QEMU expected on the socket: other peers are refused, and memfold-blk exits
    /// once it has exited.
    #[arg(long)]
    qemu_pid: Option<u32>,
    /// Serve reads at most this fast, bytes/s (a slow disk, as QEMU's `bps_rd`).
    #[arg(long, value_name = "BYTES")]
    read_bytes_per_sec: Option<u64>,
    /// Where to report landed pages (memfoldd's socket for the block device).
    #[arg(long)]
    landed_socket: Option<PathBuf>,
    /// Log every landed report at debug level instead of counting them.
    #[arg(long)]
    log_landed: bool,
    /// Buffered I/O with each range dropped from the host page cache after use, instead
    /// of O_DIRECT (to compare what the host page cache keeps).
    #[arg(long)]
    no_direct: bool,
    /// A file rewritten with the request counters (`key=value ...`) at most every 200 ms
    /// and at each disconnect.
    #[arg(long)]
    stats: Option<PathBuf>,
}

/// The sink the binary reports landed pages to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkChoice {
    /// Count them (the default).
    Counting,
    /// Log them at debug level.
    Log,
    /// Send them to memfoldd on this socket.
    Socket(PathBuf),
}

impl SinkChoice {
    fn of(a: &Args) -> SinkChoice {
        match (&a.landed_socket, a.log_landed) {
            (Some(p), _) => SinkChoice::Socket(p.clone()),
            (None, true) => SinkChoice::Log,
            (None, false) => SinkChoice::Counting,
        }
    }

    /// The sink. Errors: a sink this build has none for.
    fn sink(
        &self,
        base: Option<(memfold_blk::landed::DiskId, std::os::fd::OwnedFd)>,
    ) -> Result<Box<dyn LandedSink>, String> {
        match self {
            SinkChoice::Counting => Ok(Box::new(CountingSink::default())),
            SinkChoice::Log => Ok(Box::new(LogSink)),
            SinkChoice::Socket(p) => memfold_blk::landed::MemfolddSink::new(p, base)
                .map(|s| Box::new(s) as Box<dyn LandedSink>)
                .map_err(|e| format!("--landed-socket {}: {e}", p.display())),
        }
    }
}

fn write_stats(path: &Option<PathBuf>, b: &BlkBackend) {
    if let Some(p) = path {
        let tmp = p.with_extension("tmp");
        if std::fs::write(&tmp, b.counters().line() + "\n").is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let a = Args::parse();
    let opened: Result<(Box<dyn Disk>, String), _> = match &a.overlay {
        None => RawDisk::open_with(&a.base, !a.no_direct).map(|d| {
            let what = format!(
                "{}: raw, read-only, O_DIRECT {}",
                a.base.display(),
                d.direct()
            );
            (Box::new(d) as Box<dyn Disk>, what)
        }),
        Some(ov) => OverlayDisk::open_with(&a.base, ov, !a.no_direct).map(|d| {
            let what = format!(
                "{} over {}: O_DIRECT {}",
                ov.display(),
                a.base.display(),
                d.direct()
            );
            (Box::new(d) as Box<dyn Disk>, what)
        }),
    };
    let disk = match opened {
        Ok((d, what)) => {
            tracing::info!("{what}");
            d
        }
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let sink = match SinkChoice::of(&a).sink(disk.base_file()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let cfg = BlkConfig {
        socket: a.socket.clone(),
        serial: a.serial.clone(),
        queues: a.queues.max(1),
        expected_qemu: a.qemu_pid,
        read_bytes_per_sec: a.read_bytes_per_sec,
    };
    let backend = Arc::new(RwLock::new(BlkBackend::new(cfg, disk, sink)));
    // A stop (SIGTERM, SIGINT) is not a crash: the overlay is closed cleanly — synced,
    // its dirty marker removed — so the next open needs no repair (and no qemu-img). On
    // ctrlc's own thread; the write lock waits out a request being served, and a request
    // after the close is refused (IOERR) until the process ends.
    {
        let b = backend.clone();
        let handled = ctrlc::set_handler(move || {
            let mut g = b.write().unwrap_or_else(|p| p.into_inner());
            let code = match g.close_disk() {
                Ok(()) => 0,
                Err(e) => {
                    tracing::error!("stopping: closing the disk: {e} (the next open repairs it)");
                    1
                }
            };
            std::process::exit(code);
        });
        if let Err(e) = handled {
            tracing::warn!("no handler for SIGTERM ({e}): a stop leaves the overlay to repair");
        }
    }
    let qemu = a
        .qemu_pid
        .and_then(|p| memfold_blk::remote::Qemu::open(p).ok());
    // The stats file follows the device's work from a thread of its own.
    if a.stats.is_some() {
        let (b, path) = (backend.clone(), a.stats.clone());
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(200));
            write_stats(&path, &b.read().unwrap_or_else(|p| p.into_inner()));
        });
    }
    loop {
        let started = Instant::now();
        let mut daemon = match VhostUserDaemon::new(
            "memfold-blk".into(),
            backend.clone(),
            GuestMemoryAtomic::new(GuestMemoryMmap::new()),
        ) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!("vhost-user daemon: {e}");
                return ExitCode::FAILURE;
            }
        };
        match daemon.serve(&a.socket) {
            Ok(()) => tracing::info!(
                "QEMU disconnected after {:.1} s",
                started.elapsed().as_secs_f64()
            ),
            Err(e) => tracing::warn!("connection ended: {e}"),
        }
        let mut b = backend.write().unwrap_or_else(|p| p.into_inner());
        b.set_memory(None);
        write_stats(&a.stats, &b);
        tracing::info!("{}", b.counters().line());
        if qemu.as_ref().is_some_and(|q| !q.alive()) {
            tracing::info!("QEMU pid {} has exited", a.qemu_pid.unwrap_or(0));
            // No request can come (no guest memory, no QEMU), and the write lock keeps
            // out one a worker thread had taken: the overlay's dirty marker can go.
            return match b.close_disk() {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("closing the disk: {e} (the next open repairs it)");
                    ExitCode::FAILURE
                }
            };
        }
        drop(b);
        if started.elapsed() < Duration::from_millis(100) {
            // A connection refused at once (a wrong peer): do not spin.
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
