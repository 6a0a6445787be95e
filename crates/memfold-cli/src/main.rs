//! `memfold`: the command line. Today: `memfold bench micro` (Difference Engine §5.3).
//! `image build`, `run`, `compare`, `analyze`, `capture` and `ksm` join as the live layer lands.

mod bench;
mod plot;

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
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// The micro-benchmark of Difference Engine §5.3 driven through the engine core: zero,
    /// random, identical and 95%-similar pages; allocate, read, write one byte at 16 fixed
    /// offsets, free; each mechanism alone and all together. Prints a table of peak and
    /// final savings; writes a CSV time series and a PNG plot.
    Micro(bench::micro::MicroArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Bench {
            which: BenchCmd::Micro(args),
        } => bench::micro::run(&args),
    }
}

/// Default folder for outputs: `out/` under the current directory.
pub(crate) fn default_out(sub: &str) -> PathBuf {
    PathBuf::from("out").join(sub)
}
