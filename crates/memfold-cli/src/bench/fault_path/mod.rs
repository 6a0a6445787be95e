//! `memfold bench fault-path`: the latency of the first access to a cold page, memfold's
//! decode path against the kernel's zswap load, side by side in one run (issue 15, "The
//! fault path").
//!
//! The same pages (a seeded mix of text-like pages that compress 2–4:1 and near-random
//! ones, [`PageGen`]) are made cold two ways, then read once each, in the same order
//! (sequential, then a seeded random permutation), one volatile byte read per page timed
//! by the accessing thread itself (`Instant` before and after):
//!
//! - **memfold**: each page is compressed with the engine's codec (`--codec`, zstd level 1
//!   by default) into a store memfd, laid out by the engine's own slab allocator
//!   ([`memfold_core::slab::Slab`]: size-class slots in chunks of 1–15 pages); a page
//!   that does not compress under a page is stored raw. The "guest" memfd is written, then punched out,
//!   mapped `MAP_SHARED` and registered with a userfaultfd in `MISSING` mode (opened with
//!   the agent's features, [`memfold_sys::uffd::AGENT_FEATURES`]). A handler thread does what the
//!   agent does for a missing fault on a stashed page: `poll`, read the event, `pread`
//!   the blob from the store, decompress it, check its xxh3 checksum, `UFFDIO_COPY` it.
//!   Left out is the agent's bookkeeping (its page table of homes, the M/R bits, counters,
//!   the report to memfoldd) and its write-protected install (`UFFDIO_COPY_MODE_WP`, which
//!   needs the range registered for write-protect faults too). Every page is stored,
//!   also those over the engine's `--compress-cutoff` (3584 B), so both sides serve the
//!   same set.
//! - **kernel**: the same pages written into a memfd mapped `MAP_SHARED`, zswap enabled
//!   (the first compressor of `--zswap-compressors` the kernel takes) in front of a swap
//!   file made for the run, then `madvise(MADV_PAGEOUT)`. How many pages left RAM
//!   (`mincore`) and how many zswap took (`zswpout` of /proc/vmstat, `Zswapped:` of
//!   /proc/meminfo) is reported; the first access of each page is then a shmem swap-in
//!   that zswap decompresses in the faulting thread (or a read of the swap file, for a
//!   page zswap rejected; swap readahead may bring neighbours in with it, counted by
//!   `swap_ra`/`swap_ra_hit`).
//!
//! More sides (`--sides`), on the same pages and orders, for the clock's registration
//! (docs/peer.md, "zswap under the clock's registration"):
//!
//! - **kernel-minor**: the kernel's side with the mapping registered as the agent
//!   registers guest RAM (`MISSING | WP | MINOR`) and a handler answering each minor
//!   fault with `UFFDIO_CONTINUE`: zswap as memfold's backing under today's clock.
//! - **uffd-rbit**: resident memfd pages, PTEs zapped (`MADV_DONTNEED`), registered the
//!   same way: each first access is the clock's R bit today, a minor userfault.
//! - **kernel-rbit**: the same pages without userfaultfd: an in-kernel minor fault
//!   (fault-around maps up to 16 pages with it); which pages were touched is read back
//!   with `PAGEMAP_SCAN` and `/proc/self/pagemap`, timed.
//! - **async-rbit**: as kernel-rbit, the range registered for asynchronous write-protect
//!   only (`UFFD_FEATURE_WP_ASYNC`), as a clock would for M bits: no userfault ever, and
//!   no fault-around.
//!
//! With an R-bit side, a probe reports the kernel's userfaultfd features, fault-around,
//! and whether M bits work by `WP_ASYNC` + `PAGE_IS_WRITTEN` on a memfd.
//!
//! Each round runs both orders, the sides rotating which goes first (two alternate). Reported per
//! order and side: p50/p99/mean µs over all rounds, the ratios kernel ÷ memfold (and
//! the new sides' pairs) of the p50s and of the means with its spread across rounds, the CPU time of the whole process
//! per access (`getrusage`: the accessing thread and, for memfold, its handler thread;
//! for the kernel the decompression is in the faulting thread), and the memory each side
//! holds for the cold pages (memfold: the store memfd's allocated bytes; kernel: the
//! growth of the zswap pool, `Zswap:` of /proc/meminfo). Every page is compared with its
//! contents after the accesses: a mismatch is an error.
//!
//! Needs root (userfaultfd for kernel faults, zswap's parameters, swapon). zswap's
//! settings are written back and the swap file switched off and removed when the
//! benchmark ends, also on an error or Ctrl-C (which stops it after the current
//! measurement); a `kill -9` leaves them (see `/sys/module/zswap/parameters` and
//! `swapon --show`). zswap's counters are host-wide: run it where nothing else swaps
//! (under `flock /tmp/measure.lock` on the shared host).

mod clock;
mod pages;
mod sides;
mod stats;

pub use clock::ClockProbe;
pub use pages::{PageGen, PageKind};
use sides::{kernel_side, memfold_side, touch, Store};
pub use stats::{spread, summarize, Spread, Summary};

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use memfold_core::{CompressCodec, EngineConfig, Page, PAGE_SIZE};
use memfold_sys::reclaim::{SwapFile, Zswap};
use rand::seq::SliceRandom;
use rand::{rngs::SmallRng, SeedableRng};
use serde::Serialize;

/// Bytes in a page, as the address arithmetic wants it.
const PAGE: u64 = PAGE_SIZE as u64;

/// The engine's default codec's name, the default of `--codec`.
fn default_codec() -> &'static str {
    EngineConfig::default().compress_codec.name()
}

/// Arguments of `memfold bench fault-path`.
#[derive(Args, Clone, Debug)]
pub struct FaultPathArgs {
    /// Cold pages per measurement (4 KiB each).
    #[arg(long, default_value_t = 16384)]
    pub pages: u32,
    /// Rounds; each measures both sides in both orders (sequential, random).
    #[arg(long, default_value_t = 5)]
    pub rounds: u32,
    /// Seed of the page contents and of the random orders.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// memfold's compressor (the engine's `--compress-codec`).
    #[arg(long, default_value = default_codec())]
    pub codec: CompressCodec,
    /// Share of near-random pages, percent (the rest are text-like).
    #[arg(long, default_value_t = 20)]
    pub random_pct: u32,
    /// zswap compressors to try, in order; the first the kernel takes is used.
    #[arg(
        long,
        default_value = "zstd,lz4,lzo-rle,lzo,deflate",
        value_delimiter = ','
    )]
    pub zswap_compressors: Vec<String>,
    /// zswap's pool limit during the run, percent of RAM.
    #[arg(long, default_value_t = 20)]
    pub zswap_max_pool_percent: u32,
    /// The swap file made for the run (must not exist; removed afterwards).
    #[arg(long, default_value = "/var/tmp/memfold-fault-path.swap")]
    pub swap_file: PathBuf,
    /// memfold's handler spins on the userfaultfd (non-blocking reads) instead of
    /// sleeping in `poll` as the agent does: the faulting thread then waits for one
    /// wake-up, not two. A lower bound of the round trip, at a core's cost.
    #[arg(long)]
    pub busy_poll: bool,
    /// The sides measured, each round in a rotating order: memfold, kernel, kernel-minor
    /// (zswap behind the agent's MISSING|WP|MINOR registration), kernel-wp (zswap behind
    /// its MISSING|WP registration of the pagemap clock), uffd-rbit (a zapped
    /// resident page, a minor userfault: the clock's R bit) and kernel-rbit (a zapped
    /// resident page, no userfaultfd, R read back by PAGEMAP_SCAN), async-rbit (the same,
    /// registered for asynchronous write-protect only: no fault-around).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "memfold,kernel"
    )]
    pub sides: Vec<Side>,
    /// Busy work, µs, the minor-fault handler (kernel-minor, uffd-rbit) does before each
    /// `UFFDIO_CONTINUE`: how the round trip grows with the handler's work.
    #[arg(long, default_value_t = 0)]
    pub handler_spin_us: u64,
    /// Print the report as JSON on stdout instead of the tables.
    #[arg(long)]
    pub json: bool,
}

/// Which side a measurement is of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Side {
    /// memfold's store and userfaultfd handler.
    Memfold,
    /// zswap behind `MADV_PAGEOUT`.
    Kernel,
    /// zswap behind `MADV_PAGEOUT`, the mapping registered as the agent registers guest
    /// RAM (`MISSING | WP | MINOR`), a handler answering minor faults with
    /// `UFFDIO_CONTINUE`.
    KernelMinor,
    /// zswap behind `MADV_PAGEOUT`, the mapping registered as the agent registers guest
    /// RAM when its clock reads R from the page tables (`MISSING | WP`,
    /// `MEMFOLD_CLOCK_RBITS=pagemap`): no userfault may come, the load is the kernel's.
    KernelWp,
    /// Resident pages, PTEs zapped, registered as the agent does: the clock's R bit.
    UffdRbit,
    /// Resident pages, PTEs zapped, no userfaultfd: an in-kernel minor fault.
    KernelRbit,
    /// As `KernelRbit`, the range registered for asynchronous write-protect only (as a
    /// userfault-free clock would, for M bits): no userfault, and no fault-around.
    AsyncRbit,
}

impl Side {
    /// Its name on the command line.
    fn name(self) -> &'static str {
        match self {
            Side::Memfold => "memfold",
            Side::Kernel => "kernel",
            Side::KernelMinor => "kernel-minor",
            Side::KernelWp => "kernel-wp",
            Side::UffdRbit => "uffd-rbit",
            Side::KernelRbit => "kernel-rbit",
            Side::AsyncRbit => "async-rbit",
        }
    }

    /// Whether it pages out to zswap.
    fn zswap(self) -> bool {
        matches!(self, Side::Kernel | Side::KernelMinor | Side::KernelWp)
    }
}

/// The ratios reported, numerator ÷ denominator, where both sides ran.
const RATIOS: [(Side, Side); 7] = [
    (Side::Kernel, Side::Memfold),
    (Side::KernelMinor, Side::Memfold),
    (Side::KernelMinor, Side::Kernel),
    (Side::KernelWp, Side::Memfold),
    (Side::KernelWp, Side::Kernel),
    (Side::KernelRbit, Side::UffdRbit),
    (Side::AsyncRbit, Side::UffdRbit),
];

/// What reading R bits back without userfaultfd costs (`kernel-rbit`, `async-rbit`), ns per page of
/// the range.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct ClockCost {
    /// `MADV_DONTNEED` of the whole range, every page resident and mapped (arming).
    pub zap_ns_per_page: f64,
    /// `PAGEMAP_SCAN` for `PAGE_IS_PRESENT`, no page present.
    pub scan_none_ns_per_page: f64,
    /// `PAGEMAP_SCAN` for `PAGE_IS_PRESENT`, every page present.
    pub scan_all_ns_per_page: f64,
    /// Reading `/proc/self/pagemap` (8 bytes a page, one `pread`), every page present.
    pub pagemap_read_ns_per_page: f64,
}

/// The order pages are first accessed in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    /// Page 0, 1, 2, …
    Sequential,
    /// A seeded permutation, new each round, the same for both sides.
    Random,
}

/// One measurement: one side, one order, one round.
#[derive(Clone, Debug, Serialize)]
pub struct Measurement {
    /// Round, from 0.
    pub round: u32,
    /// Side.
    pub side: Side,
    /// Access order.
    pub order: Order,
    /// All accesses.
    pub all: Summary,
    /// Accesses to text-like pages.
    pub text: Summary,
    /// Accesses to near-random pages.
    pub random: Summary,
    /// CPU time of the process per access, µs (user + system, all threads).
    pub cpu_us_per_access: f64,
    /// Bytes of memory held for the cold pages: the store memfd's allocated bytes, or the
    /// zswap pool's growth.
    pub held_bytes: u64,
    /// Pages out of RAM before the accesses (memfold: all; kernel: per `mincore`).
    pub pages_out: u64,
    /// Pages compressed into the cold store (memfold: under a page; kernel: `zswpout`).
    pub pages_compressed: u64,
    /// Kernel only: pages zswap loaded during the accesses (`zswpin`).
    pub zswap_loads: u64,
    /// Kernel only: pages read from the swap file during the accesses (`pswpin`).
    pub disk_reads: u64,
    /// Kernel only: pages swap readahead brought in, and of those, hit (`swap_ra`,
    /// `swap_ra_hit`).
    pub readahead: (u64, u64),
    /// Faults the userfaultfd handler answered (memfold, kernel-minor, uffd-rbit).
    pub uffd_faults: u64,
    /// kernel-rbit and async-rbit: the cost of reading R bits back.
    pub clock: Option<ClockCost>,
}

/// One side's latencies over every round of one order.
#[derive(Clone, Debug, Serialize)]
pub struct Pooled {
    /// Side.
    pub side: Side,
    /// Order.
    pub order: Order,
    /// All accesses of all rounds.
    pub all: Summary,
    /// Text-like pages.
    pub text: Summary,
    /// Near-random pages.
    pub random: Summary,
    /// CPU per access, µs, across rounds.
    pub cpu_us_per_access: Spread,
    /// Memory held, bytes, across rounds.
    pub held_bytes: Spread,
}

/// One side ÷ another for one order, across rounds.
#[derive(Clone, Debug, Serialize)]
pub struct Ratio {
    /// Numerator.
    pub num: Side,
    /// Denominator.
    pub den: Side,
    /// Order.
    pub order: Order,
    /// Of the p50s.
    pub p50: Spread,
    /// Of the means.
    pub mean: Spread,
    /// Of the p99s.
    pub p99: Spread,
}

/// The benchmark's report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Pages per measurement.
    pub pages: u32,
    /// Rounds.
    pub rounds: u32,
    /// Seed.
    pub seed: u64,
    /// Near-random pages, percent.
    pub random_pct: u32,
    /// memfold's codec.
    pub codec: CompressCodec,
    /// The zswap compressor used (empty if no side paged out).
    pub zswap_compressor: String,
    /// The probe for a userfault-free clock (when an R-bit side ran).
    pub probe: Option<ClockProbe>,
    /// Kernel release.
    pub kernel: String,
    /// memfold's compression ratio (page bytes ÷ blob bytes, before slab slots).
    pub memfold_ratio: f64,
    /// Every measurement.
    pub measurements: Vec<Measurement>,
    /// Per side and order, pooled.
    pub pooled: Vec<Pooled>,
    /// Side ÷ side per order (see [`RATIOS`]).
    pub ratios: Vec<Ratio>,
}

/// Latency summaries of all, text-like and near-random pages.
fn by_kind(lat: &[u64], order: &[u32], kinds: &[PageKind]) -> (Summary, Summary, Summary) {
    let pick = |k: PageKind| -> Vec<u64> {
        lat.iter()
            .zip(order)
            .filter(|(_, &i)| kinds[i as usize] == k)
            .map(|(&l, _)| l)
            .collect()
    };
    (
        summarize(lat),
        summarize(&pick(PageKind::Text)),
        summarize(&pick(PageKind::Random)),
    )
}

/// Runs the benchmark and reports.
pub fn run(a: &FaultPathArgs) -> Result<()> {
    ensure!(
        rustix::process::geteuid().is_root(),
        "memfold bench fault-path needs root: a userfaultfd for kernel faults (CAP_SYS_PTRACE), zswap's parameters and swapon; run it with sudo"
    );
    ensure!(
        a.pages > 0 && a.rounds > 0,
        "--pages and --rounds must be positive"
    );
    ensure!(a.random_pct <= 100, "--random-pct must be in 0..=100");
    let mut sides = a.sides.clone();
    sides.dedup();
    ensure!(!sides.is_empty(), "--sides names no side");
    let zswap_needed = sides.iter().any(|s| s.zswap());
    ensure!(
        !zswap_needed || !a.swap_file.exists(),
        "{} exists: remove it (swapoff first if `swapon --show` lists it) or pass another --swap-file",
        a.swap_file.display()
    );
    let stop = crate::run::ctrl_c_flag()?;
    let gen = PageGen::new(a.seed, a.random_pct);
    let pages: Vec<Box<Page>> = (0..a.pages).map(|i| gen.page(i)).collect();
    let kinds: Vec<PageKind> = (0..a.pages).map(|i| gen.kind(i)).collect();
    let memfold_ratio = {
        let s = Store::build(&pages, a.codec)?;
        pages.len() as f64 * PAGE_SIZE as f64 / s.blob_bytes as f64
    };

    // Put back when dropped, in reverse order: the swap file off and removed, then
    // zswap's settings.
    let (zswap, compressor) = if zswap_needed {
        let (z, c) = Zswap::enable_first(&a.zswap_compressors, a.zswap_max_pool_percent)
            .context("turning zswap on")?;
        (Some(z), c)
    } else {
        (None, String::new())
    };
    // Room for every page uncompressed (zswap takes a swap slot per page it holds; a page
    // it rejects goes to the file), and a little.
    let swap = if zswap_needed {
        Some(
            SwapFile::create(&a.swap_file, u64::from(a.pages) * PAGE + (16 << 20))
                .context("the swap file behind zswap")?,
        )
    } else {
        None
    };
    if !a.json {
        eprintln!(
            "fault path: {} pages ({} MiB), {}% near-random, memfold {} (ratio {:.2}), zswap {compressor}, {} rounds, sides {}",
            a.pages,
            (u64::from(a.pages) * PAGE) >> 20,
            a.random_pct,
            a.codec.name(),
            memfold_ratio,
            a.rounds,
            sides.iter().map(|s| s.name()).collect::<Vec<_>>().join(",")
        );
    }
    let probe = if sides
        .iter()
        .any(|s| matches!(s, Side::KernelRbit | Side::UffdRbit | Side::AsyncRbit))
    {
        let p = clock::probe(&pages).context("the clock probe")?;
        if !a.json {
            eprintln!("  probe: {}", probe_line(&p));
        }
        Some(p)
    } else {
        None
    };
    let spin = std::time::Duration::from_micros(a.handler_spin_us);
    let mut measurements = Vec::new();
    for round in 0..a.rounds {
        let mut perm: Vec<u32> = (0..a.pages).collect();
        perm.shuffle(&mut SmallRng::seed_from_u64(
            a.seed.wrapping_add(u64::from(round) + 1),
        ));
        let seq: Vec<u32> = (0..a.pages).collect();
        for (order, ord) in [(Order::Sequential, &seq), (Order::Random, &perm)] {
            // Each round starts with the next side: with two, they alternate.
            let mut turn = sides.clone();
            turn.rotate_left(round as usize % sides.len());
            for &side in &turn {
                if stop.load(Ordering::SeqCst) {
                    bail!("interrupted (zswap's settings and the swap file are put back)");
                }
                let r = match side {
                    Side::Memfold => memfold_side(&pages, ord, a.codec, a.busy_poll),
                    Side::Kernel => kernel_side(&pages, ord, |m, o| {
                        let (lat, cpu) = touch(m, o);
                        Ok((lat, cpu, 0))
                    }),
                    Side::KernelMinor => kernel_side(&pages, ord, |m, o| {
                        clock::minor_access(m, o, a.busy_poll, spin)
                    }),
                    Side::KernelWp => kernel_side(&pages, ord, |m, o| {
                        clock::wp_registered_access(m, o, a.busy_poll)
                    }),
                    Side::UffdRbit => clock::uffd_rbit_side(&pages, ord, a.busy_poll, spin),
                    Side::KernelRbit => clock::kernel_rbit_side(&pages, ord, false),
                    Side::AsyncRbit => clock::kernel_rbit_side(&pages, ord, true),
                }
                .with_context(|| format!("round {round}, {order:?}, {side:?}"))?;
                let (all, text, random) = by_kind(&r.lat, ord, &kinds);
                let m = Measurement {
                    round,
                    side,
                    order,
                    all,
                    text,
                    random,
                    cpu_us_per_access: r.cpu_us,
                    held_bytes: r.held_bytes,
                    pages_out: r.pages_out,
                    pages_compressed: r.pages_compressed,
                    zswap_loads: r.zswap_loads,
                    disk_reads: r.disk_reads,
                    readahead: r.readahead,
                    uffd_faults: r.uffd_faults,
                    clock: r.clock,
                };
                if !a.json {
                    eprintln!(
                        "  round {round} {:<10} {:<12} p50 {:6.2} µs  p99 {:7.2} µs  mean {:6.2} µs  cpu {:5.2} µs/access  held {:5.1} MiB  out {} compressed {} zswpin {} pswpin {} ra {}/{} uffd faults {}{}",
                        format!("{order:?}"),
                        side.name(),
                        m.all.p50_us,
                        m.all.p99_us,
                        m.all.mean_us,
                        m.cpu_us_per_access,
                        m.held_bytes as f64 / (1 << 20) as f64,
                        m.pages_out,
                        m.pages_compressed,
                        m.zswap_loads,
                        m.disk_reads,
                        m.readahead.0,
                        m.readahead.1,
                        m.uffd_faults,
                        m.clock.map(|c| format!(
                            "  zap {:.0} ns/page, PAGEMAP_SCAN {:.1} (none present) / {:.1} (all) ns/page, pagemap read {:.1} ns/page",
                            c.zap_ns_per_page,
                            c.scan_none_ns_per_page,
                            c.scan_all_ns_per_page,
                            c.pagemap_read_ns_per_page
                        )).unwrap_or_default(),
                    );
                }
                if side.zswap() && m.pages_out < u64::from(a.pages) {
                    eprintln!(
                        "  warning: MADV_PAGEOUT left {} of {} pages in memory: their accesses are not zswap loads",
                        u64::from(a.pages) - m.pages_out,
                        a.pages
                    );
                }
                measurements.push((m, r.lat, ord.clone()));
            }
        }
    }
    drop(swap);
    drop(zswap);

    let mut pooled = Vec::new();
    let mut ratios = Vec::new();
    for order in [Order::Sequential, Order::Random] {
        for &side in &sides {
            let ms: Vec<_> = measurements
                .iter()
                .filter(|(m, _, _)| m.side == side && m.order == order)
                .collect();
            let lat: Vec<u64> = ms.iter().flat_map(|(_, l, _)| l.iter().copied()).collect();
            let ord: Vec<u32> = ms.iter().flat_map(|(_, _, o)| o.iter().copied()).collect();
            let (all, text, random) = by_kind(&lat, &ord, &kinds);
            pooled.push(Pooled {
                side,
                order,
                all,
                text,
                random,
                cpu_us_per_access: spread(
                    &ms.iter()
                        .map(|(m, _, _)| m.cpu_us_per_access)
                        .collect::<Vec<_>>(),
                ),
                held_bytes: spread(
                    &ms.iter()
                        .map(|(m, _, _)| m.held_bytes as f64)
                        .collect::<Vec<_>>(),
                ),
            });
        }
        let per_round = |num: Side, den: Side, f: fn(&Summary) -> f64| -> Spread {
            let xs: Vec<f64> = (0..a.rounds)
                .filter_map(|r| {
                    let find = |side| {
                        measurements
                            .iter()
                            .find(|(m, _, _)| m.round == r && m.order == order && m.side == side)
                            .map(|(m, _, _)| f(&m.all))
                    };
                    Some(find(num)? / find(den)?)
                })
                .collect();
            spread(&xs)
        };
        for (num, den) in RATIOS {
            if !(sides.contains(&num) && sides.contains(&den)) {
                continue;
            }
            ratios.push(Ratio {
                num,
                den,
                order,
                p50: per_round(num, den, |s| s.p50_us),
                mean: per_round(num, den, |s| s.mean_us),
                p99: per_round(num, den, |s| s.p99_us),
            });
        }
    }
    let report = Report {
        pages: a.pages,
        rounds: a.rounds,
        seed: a.seed,
        random_pct: a.random_pct,
        codec: a.codec,
        zswap_compressor: compressor,
        probe,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        memfold_ratio,
        measurements: measurements.into_iter().map(|(m, _, _)| m).collect(),
        pooled,
        ratios,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

fn print_report(r: &Report) {
    println!(
        "\nFirst access to a cold page, µs ({} pages × {} rounds; memfold {} vs zswap {}; kernel {}):",
        r.pages,
        r.rounds,
        r.codec.name(),
        r.zswap_compressor,
        r.kernel
    );
    println!(
        "{:<11} {:<12} {:>8} {:>8} {:>8} {:>10} {:>10} {:>14} {:>11}",
        "order", "side", "p50", "p99", "mean", "text p50", "rand p50", "cpu µs/access", "held MiB"
    );
    for p in &r.pooled {
        println!(
            "{:<11} {:<12} {:>8.2} {:>8.2} {:>8.2} {:>10.2} {:>10.2} {:>14.2} {:>11.1}",
            format!("{:?}", p.order),
            p.side.name(),
            p.all.p50_us,
            p.all.p99_us,
            p.all.mean_us,
            p.text.p50_us,
            p.random.p50_us,
            p.cpu_us_per_access.mean,
            p.held_bytes.mean / (1 << 20) as f64,
        );
    }
    println!("\nside ÷ side across rounds (mean ± sd [min, max]; < 1: the first is faster):");
    for x in &r.ratios {
        let f = |s: &Spread| format!("{:.2} ± {:.2} [{:.2}, {:.2}]", s.mean, s.sd, s.min, s.max);
        println!(
            "{:<27} {:<11} p50 {}   mean {}   p99 {}",
            format!("{} ÷ {}", x.num.name(), x.den.name()),
            format!("{:?}", x.order),
            f(&x.p50),
            f(&x.mean),
            f(&x.p99)
        );
    }
    for side in [Side::KernelRbit, Side::AsyncRbit] {
        let costs: Vec<ClockCost> = r
            .measurements
            .iter()
            .filter(|m| m.side == side)
            .filter_map(|m| m.clock)
            .collect();
        if costs.is_empty() {
            continue;
        }
        let f = |g: fn(&ClockCost) -> f64| {
            let s = spread(&costs.iter().map(g).collect::<Vec<_>>());
            format!("{:.1} ± {:.1} [{:.1}, {:.1}]", s.mean, s.sd, s.min, s.max)
        };
        println!(
            "\nR bits without userfaultfd ({}, ns per page of the range, over {} measurements):",
            side.name(),
            costs.len()
        );
        println!(
            "  zap (MADV_DONTNEED)              {}",
            f(|c| c.zap_ns_per_page)
        );
        println!(
            "  PAGEMAP_SCAN, none present       {}",
            f(|c| c.scan_none_ns_per_page)
        );
        println!(
            "  PAGEMAP_SCAN, all present        {}",
            f(|c| c.scan_all_ns_per_page)
        );
        println!(
            "  /proc/self/pagemap read          {}",
            f(|c| c.pagemap_read_ns_per_page)
        );
    }
    if let Some(p) = &r.probe {
        println!("\nprobe: {}", probe_line(p));
    }
}

/// The clock probe in a line.
fn probe_line(p: &ClockProbe) -> String {
    let mbit = match &p.mbit {
        Ok(m) => format!(
            "M bits by WP_ASYNC + PAGE_IS_WRITTEN on a memfd: {} of {} written pages seen, {} after the re-protecting scan; write fault p50 {:.2} µs, re-protecting scan {:.1} ns/page",
            m.seen_written, m.written, m.seen_after_rearm, m.write_fault_p50_us, m.rearm_scan_ns_per_page
        ),
        Err(e) => format!("M bits by WP_ASYNC: not here ({e})"),
    };
    format!(
        "userfaultfd features {:#x} (WP_ASYNC {}); a read fault on a zapped page maps {} of 64 pages ({} under MADV_RANDOM, {} registered async WP); {mbit}",
        p.uffd_features,
        if p.wp_async { "yes" } else { "no" },
        p.fault_around[0],
        p.fault_around[1],
        p.fault_around[2]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_kind_splits_latencies_by_the_page_accessed() {
        let kinds = [PageKind::Text, PageKind::Random, PageKind::Text];
        let order = [2, 0, 1];
        let lat = [3000, 1000, 9000];
        let (all, text, random) = by_kind(&lat, &order, &kinds);
        assert_eq!(all.n, 3);
        assert_eq!((text.n, text.p99_us), (2, 3.0));
        assert_eq!((random.n, random.p50_us), (1, 9.0));
    }
}
