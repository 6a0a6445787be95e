//! `memfold`: the command line.

mod analyze;
mod baseline;
mod bench;
mod capture;
mod census;
mod compare;
mod guests;
mod image;
mod ksm;
mod libvirt;
mod ops;
mod peer;
mod plot;
mod qemu;
mod run;
mod tradeoff;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "memfold",
    version,
    about = "Memory conservation for virtual machines: sharing, patching, compression and swap"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Guest images built from Debian packages.
    Image {
        #[command(subcommand)]
        which: ImageCmd,
    },
    /// Boot guests and snapshot their RAM (and which pages are host-resident).
    Capture(capture::CaptureArgs),
    /// Difference Engine Table 1 on RAM snapshots: zero, duplicate and unique pages, and
    /// the pages needed with sharing, + patching, + compression, per guest and together.
    Analyze(analyze::AnalyzeArgs),
    /// Run a guest set under Linux KSM (aggressive, default or both settings) and measure it
    /// as memfold is measured.
    Ksm(ksm::KsmArgs),
    /// The static baseline: boot a guest set, analyse snapshots of its RAM (DE Table 1) and
    /// measure Linux KSM (aggressive) on the same guests.
    Baseline(baseline::BaselineArgs),
    /// The main job: boot a guest set with memfold's agent, run memfoldd, show live savings.
    Run(run::RunArgs),
    /// The same guest set under memfold (--policy, the Difference Engine by default), then
    /// under Linux KSM (aggressive) on fresh boots, measured alike.
    Compare(compare::CompareArgs),
    /// Run your own QEMU command line with memfold's agent: checks guest RAM is a shared
    /// memfd backend (or says exactly what to add, exit status 2), then execs QEMU with
    /// LD_PRELOAD and the agent's environment (docs/operations.md, "Your own QEMU").
    Qemu(qemu::QemuArgs),
    /// Put libvirt domains under memfold or take them out (`enable DOMAIN`, `disable
    /// DOMAIN`): edits each domain's persistent XML through virsh (docs/operations.md).
    Libvirt {
        #[command(subcommand)]
        which: libvirt::LibvirtCmd,
    },
    /// Take a running guest out of memfold (as KSM's MADV_UNMERGEABLE): every page
    /// memfoldd holds for it — shared, stored, reclaimed — goes back into its own RAM,
    /// and nothing of it is shared or stored again until `memfold merge`. It holds across
    /// memfoldd's restarts for as long as the guest's QEMU runs (recorded beside
    /// memfoldd's socket, `SOCKET.opt-outs`).
    Unmerge(OptArgs),
    /// One look at a running memfoldd: per guest the host memory, the pages each
    /// mechanism holds, CoW breaks/s and faults/s (two samples --interval apart), the
    /// total and the savings by mechanism; --json for scripts.
    Status(ops::StatusArgs),
    /// A full-screen live view of a running memfoldd: a row per guest and the total,
    /// refreshed every --interval seconds; q quits.
    Top(ops::top::TopArgs),
    /// Let memfold manage a guest taken out by `memfold unmerge` again.
    Merge(OptArgs),
    /// Host memory left against guest slowdown for every side of `memfold compare` runs
    /// (their `compare.json`): a table per guest set, the goal's verdict (memfold ≤ 0.75×
    /// the best peer's memory at no more slowdown and CPU), and a chart (--png).
    Tradeoff(tradeoff::TradeoffArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
}

/// A guest and the memfoldd that manages it.
#[derive(clap::Args)]
struct OptArgs {
    /// The guest's name (as memfoldd lists it).
    name: String,
    /// memfoldd's socket.
    #[arg(long, default_value = memfold_cli::DEFAULT_SOCKET)]
    socket: PathBuf,
}

#[derive(Subcommand)]
enum ImageCmd {
    /// Build (or reuse) images: tiny, web, db, py, web-trixie, py-trixie (all if none named).
    Build { names: Vec<String> },
    /// List the profiles and whether each is built.
    List,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// The micro-benchmark of Difference Engine §5.3 driven through the engine core: zero,
    /// random, identical and 95%-similar pages; allocate, read, write one byte at 16 fixed
    /// offsets, free; each mechanism alone and all together. Prints the savings at each
    /// phase event and a table of peak and final savings; writes a CSV time series and a
    /// PNG plot.
    Micro(bench::micro::MicroArgs),
    /// The first access to a cold page, memfold's decode (a store memfd, a userfaultfd
    /// handler that reads, decompresses, checks and copies) against the kernel's zswap
    /// load (MADV_PAGEOUT into zswap, swapped in on access), side by side: p50/p99/mean
    /// µs, CPU per access and memory held, in sequential and random order. Needs root;
    /// turns zswap on and adds a swap file for the run, both put back afterwards.
    FaultPath(bench::fault_path::FaultPathArgs),
    /// How memfold's costs grow with the number of guests (`--vms 1,2,4,8,12,16`) and
    /// their size (`--sizes 512,2048,4096,8192`, MiB), each point measured as `memfold
    /// compare` measures (memfold, then KSM aggressive, fresh boots): saved fraction, time
    /// to 95%, CPU per GiB saved, scan throughput, mappings per QEMU, latencies,
    /// metadata and memfoldd's memory; with each cost's slope. Needs root.
    Scale(Box<bench::scale::ScaleArgs>),
    /// The write-latency side channel of page sharing (Satori §4.3): an attacker guest
    /// builds pages equal to a victim guest's guessed secrets, waits past the scan
    /// interval and times a write to each (a copy-on-write break is slow), with the
    /// secret present or absent; prints the attacker's accuracy without never-share and
    /// (`--never-share`, `--both`) with the victim marked never-share. Needs root; boots
    /// two tiny guests (docs/side-channel.md).
    SideChannel(bench::side_channel::SideChannelArgs),
    /// Guest disk throughput, memfold-blk (vhost-user-blk) against QEMU's virtio-blk, side
    /// by side in one run: O_DIRECT 4 KiB sequential, 4 KiB random and 1 MiB sequential
    /// reads in two tiny guests, each side's bytes / time over its rounds ± 2 s.e. and the
    /// ratio; `--workloads`
    /// adds the built-in workloads on each disk. Needs root (docs/sharing-at-read.md).
    DiskIo(Box<bench::disk_io::DiskIoArgs>),
    /// How soon a page a guest reads, that another guest already holds, is shared: per
    /// page from its read to its sharing, p50/p99 and time to 95% per round, for memfold
    /// with memfold-blk, memfold's scan alone and KSM aggressive. Needs root
    /// (docs/sharing-at-read.md).
    ReadShare(Box<bench::read_share::ReadShareArgs>),
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        // The cause chain, one line: what failed and where, without a backtrace.
        eprintln!("memfold: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Image {
            which: ImageCmd::Build { names },
        } => image::build(&names),
        Cmd::Image {
            which: ImageCmd::List,
        } => {
            image::list();
            Ok(())
        }
        Cmd::Capture(a) => capture::run(&a),
        Cmd::Analyze(a) => analyze::run(&a),
        Cmd::Ksm(a) => ksm::run(&a),
        Cmd::Baseline(a) => baseline::run(&a),
        Cmd::Run(a) => run::run(&a),
        Cmd::Compare(a) => compare::run(&a),
        Cmd::Tradeoff(a) => tradeoff::run(&a),
        Cmd::Qemu(a) => match qemu::run(&a) {
            Ok(never) => match never {},
            Err(e @ qemu::QemuError::NotShareable(_)) => {
                eprintln!("memfold qemu: {e}");
                std::process::exit(qemu::EXIT_NOT_SHAREABLE);
            }
            Err(e) => Err(e.into()),
        },
        Cmd::Libvirt { which } => match which {
            libvirt::LibvirtCmd::Enable(a) => Ok(libvirt::enable(&a)?),
            libvirt::LibvirtCmd::Disable(a) => Ok(libvirt::disable(&a)?),
        },
        Cmd::Unmerge(a) => {
            let pages = memfold_live::opt_out(&a.socket, &a.name, true)
                .map_err(|e| anyhow::anyhow!("{}: {e}", a.socket.display()))?;
            println!(
                "{}: opted out; {pages} pages are being taken back into its RAM",
                a.name
            );
            Ok(())
        }
        Cmd::Status(a) => Ok(ops::status(&a)?),
        Cmd::Top(a) => Ok(ops::top::run(&a)?),
        Cmd::Merge(a) => {
            memfold_live::opt_out(&a.socket, &a.name, false)
                .map_err(|e| anyhow::anyhow!("{}: {e}", a.socket.display()))?;
            println!("{}: managed by memfold again", a.name);
            Ok(())
        }
        Cmd::Bench {
            which: BenchCmd::Micro(args),
        } => bench::micro::run(&args),
        Cmd::Bench {
            which: BenchCmd::FaultPath(args),
        } => bench::fault_path::run(&args),
        Cmd::Bench {
            which: BenchCmd::Scale(args),
        } => bench::scale::run(&args),
        Cmd::Bench {
            which: BenchCmd::SideChannel(args),
        } => bench::side_channel::run(&args),
        Cmd::Bench {
            which: BenchCmd::DiskIo(args),
        } => bench::disk_io::run(&args),
        Cmd::Bench {
            which: BenchCmd::ReadShare(args),
        } => bench::read_share::run(&args),
    }
}

/// Default folder for outputs: `out/` under the current directory.
pub(crate) fn default_out(sub: &str) -> PathBuf {
    PathBuf::from("out").join(sub)
}

/// Creates `path` for a CSV (or other text) output, buffered.
///
/// Errors: the file cannot be created (the message names it).
pub(crate) fn create_output(
    path: &std::path::Path,
) -> anyhow::Result<std::io::BufWriter<std::fs::File>> {
    use anyhow::Context;
    Ok(std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("cannot write {}", path.display()))?,
    ))
}
