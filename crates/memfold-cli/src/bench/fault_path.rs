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
//!   ([`memfold_core::slab::Slab`]: size-class slots in 4 KiB chunks); a page that does not
//!   compress under a page is stored raw. The "guest" memfd is written, then punched out,
//!   mapped `MAP_SHARED` and registered with a userfaultfd in `MISSING` mode (opened with
//!   the agent's features, [`uffd::AGENT_FEATURES`]). A handler thread does what the
//!   agent does for a missing fault on a stashed page: `poll`, read the event, `pread`
//!   the blob from the store, decompress it, check its xxh3 checksum, `UFFDIO_COPY` it.
//!   Left out is the agent's bookkeeping (its page table of homes, the M/R bits, counters,
//!   the report to memfoldd) and its write-protected install (`UFFDIO_COPY_MODE_WP`, which
//!   needs the range registered for write-protect faults too). Every page is stored,
//!   also those over the engine's `--compress-cutoff` (2048 B), so both sides serve the
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
//! Each round runs both orders, the two sides alternating which goes first. Reported per
//! order and side: p50/p99/mean µs over all rounds, the ratio kernel ÷ memfold of the
//! p50s and of the means with its spread across rounds, the CPU time of the whole process
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

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use memfold_codecs::page_checksum;
use memfold_core::slab::Slab;
use memfold_core::{CompressCodec, EngineConfig, Page, PAGE_SIZE};
use memfold_sys::reclaim::{self, ReclaimError, SwapFile, Zswap};
use memfold_sys::{memfd, uffd};
use rand::seq::SliceRandom;
use rand::{rngs::SmallRng, Rng, SeedableRng};
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
    /// Print the report as JSON on stdout instead of the tables.
    #[arg(long)]
    pub json: bool,
}

/// What a generated page is like.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PageKind {
    /// Text-like: words of a vocabulary, numbers, identifiers; compresses 2–4:1.
    Text,
    /// Near-random: random bytes with a few zero runs; compresses just under a page.
    Random,
}

/// A seeded generator of page contents: page `i` is the same for the same seed, whatever
/// else was generated.
pub struct PageGen {
    seed: u64,
    random_pct: u32,
    vocabulary: Vec<Vec<u8>>,
}

/// Words in a generator's vocabulary.
const VOCABULARY: usize = 1024;
/// Text-like pages: tokens that are words, percent (minus one: a match arm's bound).
const TEXT_WORDS_PCT: u32 = 89;
/// Tokens that are numbers (1–8 digits): this range of the percent draw; the rest are
/// hex identifiers.
const TEXT_NUMBER_FROM: u32 = TEXT_WORDS_PCT + 1;
const TEXT_NUMBER_TO: u32 = 97;
/// Text-like pages: tokens that repeat a phrase from earlier in the page, percent.
const TEXT_REPEAT_PCT: u32 = 33;
/// Skew of the word choice: word `⌊u^k · VOCABULARY⌋` for uniform `u`.
const TEXT_SKEW: i32 = 4;

impl PageGen {
    /// A generator for `seed`; `random_pct` percent of pages (0..=100) are near-random.
    pub fn new(seed: u64, random_pct: u32) -> PageGen {
        let mut r = SmallRng::seed_from_u64(seed);
        let vocabulary = (0..VOCABULARY)
            .map(|_| {
                let len = r.gen_range(2..=10);
                (0..len).map(|_| r.gen_range(b'a'..=b'z')).collect()
            })
            .collect();
        PageGen {
            seed,
            random_pct: random_pct.min(100),
            vocabulary,
        }
    }

    fn rng(&self, i: u32) -> SmallRng {
        SmallRng::seed_from_u64(self.seed ^ (u64::from(i) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    /// The kind of page `i`.
    pub fn kind(&self, i: u32) -> PageKind {
        if self.rng(i).gen_range(0..100) < self.random_pct {
            PageKind::Random
        } else {
            PageKind::Text
        }
    }

    /// Page `i`'s contents.
    pub fn page(&self, i: u32) -> Box<Page> {
        let kind = self.kind(i);
        let mut r = self.rng(i);
        r.gen::<u64>(); // the draw that decided the kind
        let mut p = Box::new([0u8; PAGE_SIZE]);
        match kind {
            PageKind::Random => {
                r.fill(&mut p[..]);
                // Eight zero runs of 64 bytes: 1/8 of the page, so every codec gets it
                // under a page, barely.
                for _ in 0..8 {
                    let at = r.gen_range(0..PAGE_SIZE / 64) * 64;
                    p[at..at + 64].fill(0);
                }
            }
            PageKind::Text => {
                let mut text = Vec::with_capacity(PAGE_SIZE + 32);
                while text.len() < PAGE_SIZE {
                    // A phrase seen earlier in the page, repeated (log lines, markup, code
                    // repeat whole phrases): what gives LZ codecs long matches.
                    if text.len() > 256 && r.gen_range(0..100) < TEXT_REPEAT_PCT {
                        let len = r.gen_range(16..=48);
                        let from = r.gen_range(0..text.len() - len);
                        text.extend_from_within(from..from + len);
                        continue;
                    }
                    match r.gen_range(0..100) {
                        0..=TEXT_WORDS_PCT => {
                            // Skewed towards the first words, as text is (Zipf-like):
                            // words repeat within a page, which is what LZ codecs find.
                            let u: f64 = r.gen();
                            let w = (u.powi(TEXT_SKEW) * VOCABULARY as f64) as usize;
                            text.extend_from_slice(&self.vocabulary[w.min(VOCABULARY - 1)])
                        }
                        TEXT_NUMBER_FROM..=TEXT_NUMBER_TO => {
                            let digits = r.gen_range(1..=8);
                            text.extend((0..digits).map(|_| r.gen_range(b'0'..=b'9')));
                        }
                        _ => {
                            let hex = b"0123456789abcdef";
                            let n = r.gen_range(8..=16);
                            text.extend((0..n).map(|_| hex[r.gen_range(0..16)]));
                        }
                    }
                    text.push(match r.gen_range(0..20) {
                        0 => b'\n',
                        1 => b',',
                        2 => b'=',
                        _ => b' ',
                    });
                }
                p.copy_from_slice(&text[..PAGE_SIZE]);
            }
        }
        p
    }
}

/// Latencies summarised: µs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Summary {
    /// Samples.
    pub n: usize,
    /// Median, µs (nearest rank).
    pub p50_us: f64,
    /// 99th percentile, µs (nearest rank).
    pub p99_us: f64,
    /// Mean, µs.
    pub mean_us: f64,
}

/// The nearest-rank `p`-quantile (0 < p ≤ 1) of sorted samples; 0 for none.
fn quantile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Summarises latencies given in ns; all zeros for none.
pub fn summarize(ns: &[u64]) -> Summary {
    let mut s = ns.to_vec();
    s.sort_unstable();
    let mean = if s.is_empty() {
        0.0
    } else {
        s.iter().map(|&x| x as f64).sum::<f64>() / s.len() as f64
    };
    Summary {
        n: s.len(),
        p50_us: quantile(&s, 0.50) as f64 / 1e3,
        p99_us: quantile(&s, 0.99) as f64 / 1e3,
        mean_us: mean / 1e3,
    }
}

/// The spread of one figure across rounds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Spread {
    /// Mean.
    pub mean: f64,
    /// Sample standard deviation (0 for fewer than two values).
    pub sd: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

/// The spread of `xs`; all zeros for none.
pub fn spread(xs: &[f64]) -> Spread {
    if xs.is_empty() {
        return Spread {
            mean: 0.0,
            sd: 0.0,
            min: 0.0,
            max: 0.0,
        };
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let sd = if xs.len() < 2 {
        0.0
    } else {
        (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
    };
    Spread {
        mean,
        sd,
        min: xs.iter().copied().fold(f64::INFINITY, f64::min),
        max: xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    }
}

/// Which side a measurement is of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// memfold's store and userfaultfd handler.
    Memfold,
    /// zswap behind `MADV_PAGEOUT`.
    Kernel,
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

/// kernel ÷ memfold for one order, across rounds.
#[derive(Clone, Debug, Serialize)]
pub struct Ratio {
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
    /// The zswap compressor used.
    pub zswap_compressor: String,
    /// Kernel release.
    pub kernel: String,
    /// memfold's compression ratio (page bytes ÷ blob bytes, before slab slots).
    pub memfold_ratio: f64,
    /// Every measurement.
    pub measurements: Vec<Measurement>,
    /// Per side and order, pooled.
    pub pooled: Vec<Pooled>,
    /// kernel ÷ memfold per order.
    pub ratios: Vec<Ratio>,
}

/// A `MAP_SHARED` read-write mapping of a whole memfd, unmapped when dropped.
struct Mapping {
    addr: *mut u8,
    len: usize,
}

impl Mapping {
    fn shared(fd: BorrowedFd<'_>, len: usize) -> Result<Mapping> {
        use rustix::mm::{MapFlags, ProtFlags};
        // SAFETY: a new mapping at an address the kernel picks: it overlaps nothing of
        // this program; its memory is only reached through raw pointers of this module.
        let addr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }
        .context("mmap of a memfd")?;
        Ok(Mapping {
            addr: addr.cast(),
            len,
        })
    }

    fn base(&self) -> u64 {
        self.addr as u64
    }

    /// The first byte of page `i`.
    fn page(&self, i: u32) -> *mut u8 {
        debug_assert!((i as usize + 1) * PAGE_SIZE <= self.len);
        // SAFETY: within the mapping (callers pass pages below its length).
        unsafe { self.addr.add(i as usize * PAGE_SIZE) }
    }

    /// Writes `pages` into the mapping, page `i` at page `i`.
    fn fill(&self, pages: &[Box<Page>]) {
        for (i, p) in pages.iter().enumerate() {
            // SAFETY: page `i` of the mapping is 4096 writable bytes no reference covers;
            // the source is a distinct heap page.
            unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), self.page(i as u32), PAGE_SIZE) };
        }
    }

    /// How many pages differ from `pages` (every page is present by then: reading them
    /// faults no more).
    fn mismatches(&self, pages: &[Box<Page>]) -> u64 {
        pages
            .iter()
            .enumerate()
            .filter(|(i, p)| {
                // SAFETY: page `i` of the mapping, readable, and written by no one while
                // this slice lives (the accesses are over, the handler has stopped).
                let m = unsafe { std::slice::from_raw_parts(self.page(*i as u32), PAGE_SIZE) };
                m != &p[..]
            })
            .count() as u64
    }

    /// Pages of the mapping in memory now (`mincore`).
    fn resident(&self) -> Result<u64> {
        let mut v = vec![0u8; self.len / PAGE_SIZE];
        // SAFETY: the range is this mapping; `v` has a byte per page of it.
        let rc = unsafe { libc::mincore(self.addr.cast(), self.len, v.as_mut_ptr()) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error()).context("mincore");
        }
        Ok(v.iter().filter(|&&b| b & 1 != 0).count() as u64)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `shared`, unmapped once; nothing points into it
        // after this.
        let _ = unsafe { rustix::mm::munmap(self.addr.cast(), self.len) };
    }
}

/// CPU time of this process so far (user + system, every thread), µs.
fn cpu_us() -> u64 {
    // SAFETY: an all-zero rusage is a valid value for getrusage to overwrite.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes the struct it is given, which lives across the call.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    us(u.ru_utime) + us(u.ru_stime)
}

/// Counters of /proc/vmstat, in the order asked.
fn vmstat(names: &[&str]) -> Result<Vec<u64>> {
    let text = std::fs::read_to_string("/proc/vmstat").context("/proc/vmstat")?;
    names
        .iter()
        .map(|n| {
            text.lines()
                .find_map(|l| l.strip_prefix(n).and_then(|r| r.strip_prefix(' ')))
                .and_then(|v| v.trim().parse().ok())
                .with_context(|| {
                    format!("/proc/vmstat has no {n} (a kernel without zswap or swap counters)")
                })
        })
        .collect()
}

/// The timed accesses: one volatile byte read of each page in `order`; the latencies, ns,
/// in `order`, and the process's CPU time per access, µs.
fn touch(m: &Mapping, order: &[u32]) -> (Vec<u64>, f64) {
    let mut lat = Vec::with_capacity(order.len());
    let mut sink = 0u8;
    let cpu0 = cpu_us();
    for &i in order {
        let p = m.page(i);
        let t = Instant::now();
        // SAFETY: the first byte of a page of the mapping, read through a raw pointer (the
        // memory may be filled by the kernel under us: no reference covers it).
        let b = unsafe { std::ptr::read_volatile(p) };
        lat.push(t.elapsed().as_nanos() as u64);
        sink ^= b;
    }
    let cpu = (cpu_us() - cpu0) as f64 / order.len().max(1) as f64;
    std::hint::black_box(sink);
    (lat, cpu)
}

/// A page's blob in the store.
#[derive(Clone, Copy)]
struct Stored {
    offset: u64,
    len: u32,
    /// Compressed (else the raw page).
    compressed: bool,
    checksum: u64,
}

/// The store: the blobs of `pages` in a memfd laid out by the engine's slab.
struct Store {
    fd: OwnedFd,
    index: Vec<Stored>,
    blob_bytes: u64,
    compressed: u64,
}

impl Store {
    fn build(pages: &[Box<Page>], codec: CompressCodec) -> Result<Store> {
        let fd = memfd::create("memfold-bench-store").context("store memfd")?;
        let mut slab = Slab::new();
        let mut index = Vec::with_capacity(pages.len());
        let mut blob = Vec::with_capacity(2 * PAGE_SIZE);
        let (mut blob_bytes, mut compressed) = (0, 0);
        for p in pages {
            codec
                .compress(p, &mut blob)
                .with_context(|| format!("{} compression", codec.name()))?;
            let fits = blob.len() < PAGE_SIZE;
            let bytes: &[u8] = if fits { &blob } else { &p[..] };
            let slot = slab
                .alloc(bytes.len())
                .context("the slab has no slot for a blob")?;
            memfd::pwrite_all(fd.as_fd(), bytes, slot.offset).context("writing the store")?;
            index.push(Stored {
                offset: slot.offset,
                len: bytes.len() as u32,
                compressed: fits,
                checksum: page_checksum(p),
            });
            blob_bytes += bytes.len() as u64;
            compressed += u64::from(fits);
        }
        Ok(Store {
            fd,
            index,
            blob_bytes,
            compressed,
        })
    }
}

/// Why the fault handler stopped.
#[derive(Debug, thiserror::Error)]
enum HandlerError {
    #[error("userfaultfd: {0}")]
    Uffd(#[from] uffd::UffdError),
    #[error("poll on the userfaultfd: {0}")]
    Poll(std::io::Error),
    #[error("reading the blob of page {page}: {source}")]
    Read { page: u64, source: std::io::Error },
    #[error("page {page}: {source}")]
    Decode {
        page: u64,
        source: memfold_codecs::CodecError,
    },
    #[error("page {0}: the decoded page does not match its checksum")]
    Checksum(u64),
}

/// Sleeps in `poll` until the userfaultfd has an event (or 100 ms pass), as the agent
/// does; not at all if an ioctl queued events meanwhile.
fn wait_readable(uffd: &uffd::Uffd) -> Result<(), HandlerError> {
    let mut fds = [libc::pollfd {
        fd: uffd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    let wait = if uffd.has_backlog() { 0 } else { 100 };
    // SAFETY: polls a valid array of one pollfd that lives across the call.
    if unsafe { libc::poll(fds.as_mut_ptr(), 1, wait) } < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(HandlerError::Poll(e));
        }
    }
    Ok(())
}

/// The agent's work on a missing fault on a stashed page, for every fault until `stop`:
/// read the blob, decompress, check, `UFFDIO_COPY`. Owns the userfaultfd: if it fails,
/// returning closes it, which lets a waiting access go on (it then reads zeros, which
/// the check of the contents reports).
fn serve(
    uffd: uffd::Uffd,
    base: u64,
    store: &Store,
    codec: CompressCodec,
    busy_poll: bool,
    stop: &AtomicBool,
) -> Result<u64, HandlerError> {
    let mut served = 0;
    let mut buf = [0u8; PAGE_SIZE];
    let mut page = [0u8; PAGE_SIZE];
    while !stop.load(Ordering::Relaxed) {
        if busy_poll {
            std::hint::spin_loop();
        } else {
            wait_readable(&uffd)?;
        }
        while let Some(ev) = uffd.read_event()? {
            let uffd::Event::Fault { addr, .. } = ev else {
                continue;
            };
            let at = addr & !(PAGE - 1);
            let i = (at - base) / PAGE;
            let Some(s) = store.index.get(i as usize) else {
                uffd.wake(at, PAGE)?;
                continue;
            };
            let blob = &mut buf[..s.len as usize];
            memfd::pread_exact(store.fd.as_fd(), blob, s.offset)
                .map_err(|source| HandlerError::Read { page: i, source })?;
            if s.compressed {
                codec
                    .decompress(blob, &mut page)
                    .map_err(|source| HandlerError::Decode { page: i, source })?;
            } else {
                page.copy_from_slice(blob);
            }
            if page_checksum(&page) != s.checksum {
                return Err(HandlerError::Checksum(i));
            }
            uffd.copy(at, &page, false)?;
            served += 1;
        }
    }
    Ok(served)
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

/// What one measurement of either side gives back before it is labelled.
struct Raw {
    lat: Vec<u64>,
    cpu_us: f64,
    held_bytes: u64,
    pages_out: u64,
    pages_compressed: u64,
    zswap_loads: u64,
    disk_reads: u64,
    readahead: (u64, u64),
}

/// memfold's side: store, punch, register, serve, access.
fn memfold_side(
    pages: &[Box<Page>],
    order: &[u32],
    codec: CompressCodec,
    busy_poll: bool,
) -> Result<Raw> {
    let len = pages.len() * PAGE_SIZE;
    let store = Store::build(pages, codec)?;
    let held_bytes = memfd::allocated_bytes(store.fd.as_fd());
    let guest = memfd::create("memfold-bench-guest").context("guest memfd")?;
    memfd::set_len(guest.as_fd(), len as u64).context("sizing the guest memfd")?;
    let m = Mapping::shared(guest.as_fd(), len)?;
    m.fill(pages);
    // Stashed: punched out, as memfoldd's stash leaves a page.
    ensure!(
        memfd::punch_hole(guest.as_fd(), 0, len as u64),
        "punching the guest memfd failed"
    );
    ensure!(
        m.resident()? == 0,
        "pages of the guest memfd are still in memory after the punch"
    );
    let u = uffd::Uffd::open(uffd::AGENT_FEATURES)
        .context("memfold's side needs a userfaultfd with the agent's features")?;
    // SAFETY: the range is `m`, a shared mapping of a memfd that only raw pointers of this
    // module reach; every fault on it is served by the handler thread below, which owns
    // the userfaultfd and closes it when it stops (unregistering the range).
    unsafe { u.register(m.base(), len as u64, uffd::MODE_MISSING) }
        .context("registering the guest mapping")?;
    let stop = AtomicBool::new(false);
    let base = m.base();
    let (lat, cpu_us, served) = std::thread::scope(|s| {
        let (store, stop_ref) = (&store, &stop);
        let h = s.spawn(move || serve(u, base, store, codec, busy_poll, stop_ref));
        let (lat, cpu) = touch(&m, order);
        stop.store(true, Ordering::Relaxed);
        let served = h.join().expect("the fault handler panicked");
        (lat, cpu, served)
    });
    let served = served.context("memfold's fault handler")?;
    let bad = m.mismatches(pages);
    ensure!(bad == 0, "memfold's side: {bad} pages read back wrong");
    ensure!(
        served == pages.len() as u64,
        "memfold's side served {served} faults for {} pages",
        pages.len()
    );
    Ok(Raw {
        lat,
        cpu_us,
        held_bytes,
        pages_out: pages.len() as u64,
        pages_compressed: store.compressed,
        zswap_loads: 0,
        disk_reads: 0,
        readahead: (0, 0),
    })
}

/// The kernel's side: write, page out to zswap, access. zswap and the swap file are on.
fn kernel_side(pages: &[Box<Page>], order: &[u32]) -> Result<Raw> {
    const COUNTERS: [&str; 5] = ["zswpout", "zswpin", "pswpin", "swap_ra", "swap_ra_hit"];
    let len = pages.len() * PAGE_SIZE;
    let guest = memfd::create("memfold-bench-zswap").context("memfd")?;
    memfd::set_len(guest.as_fd(), len as u64).context("sizing the memfd")?;
    let m = Mapping::shared(guest.as_fd(), len)?;
    m.fill(pages);
    let (pool0, _) = reclaim::zswap_pool()?;
    let before = vmstat(&COUNTERS)?;
    // A page still on a per-CPU LRU list is skipped by MADV_PAGEOUT: try again a few times.
    for _ in 0..4 {
        // SAFETY: advice on this mapping; paging out changes no contents.
        unsafe { rustix::mm::madvise(m.addr.cast(), len, rustix::mm::Advice::LinuxPageOut) }
            .context("madvise(MADV_PAGEOUT)")?;
        if m.resident()? == 0 {
            break;
        }
    }
    let pages_out = pages.len() as u64 - m.resident()?;
    let (pool1, _) = reclaim::zswap_pool()?;
    let mid = vmstat(&COUNTERS)?;
    let (lat, cpu_us) = touch(&m, order);
    let after = vmstat(&COUNTERS)?;
    let bad = m.mismatches(pages);
    ensure!(bad == 0, "the kernel's side: {bad} pages read back wrong");
    Ok(Raw {
        lat,
        cpu_us,
        held_bytes: pool1.saturating_sub(pool0),
        pages_out,
        pages_compressed: mid[0] - before[0],
        zswap_loads: after[1] - mid[1],
        disk_reads: after[2] - mid[2],
        readahead: (after[3] - mid[3], after[4] - mid[4]),
    })
}

/// zswap on with the first of `names` the kernel takes.
fn enable_zswap(names: &[String], pool_pct: u32) -> Result<(Zswap, String)> {
    let mut refused = Vec::new();
    for name in names {
        match Zswap::enable(name, pool_pct) {
            Ok(z) => return Ok((z, name.clone())),
            Err(ReclaimError::Unavailable(why)) => refused.push(why),
            Err(e) => return Err(e).context("turning zswap on"),
        }
    }
    bail!(
        "zswap took none of the compressors {names:?}: {}",
        refused.join("; ")
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
    ensure!(
        !a.swap_file.exists(),
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
    let (zswap, compressor) = enable_zswap(&a.zswap_compressors, a.zswap_max_pool_percent)?;
    // Room for every page uncompressed (zswap takes a swap slot per page it holds; a page
    // it rejects goes to the file), and a little.
    let swap = SwapFile::create(&a.swap_file, u64::from(a.pages) * PAGE + (16 << 20))
        .context("the swap file behind zswap")?;
    if !a.json {
        eprintln!(
            "fault path: {} pages ({} MiB), {}% near-random, memfold {} (ratio {:.2}), zswap {compressor}, {} rounds",
            a.pages,
            (u64::from(a.pages) * PAGE) >> 20,
            a.random_pct,
            a.codec.name(),
            memfold_ratio,
            a.rounds
        );
    }
    let mut measurements = Vec::new();
    for round in 0..a.rounds {
        let mut perm: Vec<u32> = (0..a.pages).collect();
        perm.shuffle(&mut SmallRng::seed_from_u64(
            a.seed.wrapping_add(u64::from(round) + 1),
        ));
        let seq: Vec<u32> = (0..a.pages).collect();
        for (order, ord) in [(Order::Sequential, &seq), (Order::Random, &perm)] {
            let sides = if round % 2 == 0 {
                [Side::Memfold, Side::Kernel]
            } else {
                [Side::Kernel, Side::Memfold]
            };
            for side in sides {
                if stop.load(Ordering::SeqCst) {
                    bail!("interrupted (zswap's settings and the swap file are put back)");
                }
                let r = match side {
                    Side::Memfold => memfold_side(&pages, ord, a.codec, a.busy_poll),
                    Side::Kernel => kernel_side(&pages, ord),
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
                };
                if !a.json {
                    eprintln!(
                        "  round {round} {:<10} {:<7} p50 {:6.2} µs  p99 {:7.2} µs  mean {:6.2} µs  cpu {:5.2} µs/access  held {:5.1} MiB  out {} compressed {} zswpin {} pswpin {} ra {}/{}",
                        format!("{order:?}"),
                        format!("{side:?}"),
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
                    );
                }
                if side == Side::Kernel && m.pages_out < u64::from(a.pages) {
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
        for side in [Side::Memfold, Side::Kernel] {
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
        let per_round = |f: fn(&Summary) -> f64| -> Spread {
            let xs: Vec<f64> = (0..a.rounds)
                .filter_map(|r| {
                    let find = |side| {
                        measurements
                            .iter()
                            .find(|(m, _, _)| m.round == r && m.order == order && m.side == side)
                            .map(|(m, _, _)| f(&m.all))
                    };
                    Some(find(Side::Kernel)? / find(Side::Memfold)?)
                })
                .collect();
            spread(&xs)
        };
        ratios.push(Ratio {
            order,
            p50: per_round(|s| s.p50_us),
            mean: per_round(|s| s.mean_us),
            p99: per_round(|s| s.p99_us),
        });
    }
    let report = Report {
        pages: a.pages,
        rounds: a.rounds,
        seed: a.seed,
        random_pct: a.random_pct,
        codec: a.codec,
        zswap_compressor: compressor,
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
        "{:<11} {:<8} {:>8} {:>8} {:>8} {:>10} {:>10} {:>14} {:>11}",
        "order", "side", "p50", "p99", "mean", "text p50", "rand p50", "cpu µs/access", "held MiB"
    );
    for p in &r.pooled {
        println!(
            "{:<11} {:<8} {:>8.2} {:>8.2} {:>8.2} {:>10.2} {:>10.2} {:>14.2} {:>11.1}",
            format!("{:?}", p.order),
            format!("{:?}", p.side),
            p.all.p50_us,
            p.all.p99_us,
            p.all.mean_us,
            p.text.p50_us,
            p.random.p50_us,
            p.cpu_us_per_access.mean,
            p.held_bytes.mean / (1 << 20) as f64,
        );
    }
    println!("\nkernel ÷ memfold across rounds (mean ± sd [min, max]; < 1: the kernel is faster):");
    for x in &r.ratios {
        let f = |s: &Spread| format!("{:.2} ± {:.2} [{:.2}, {:.2}]", s.mean, s.sd, s.min, s.max);
        println!(
            "{:<11} p50 {}   mean {}   p99 {}",
            format!("{:?}", x.order),
            f(&x.p50),
            f(&x.mean),
            f(&x.p99)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ratio(codec: CompressCodec, p: &Page) -> f64 {
        let mut out = Vec::new();
        codec.compress(p, &mut out).unwrap();
        PAGE_SIZE as f64 / out.len() as f64
    }

    #[test]
    fn text_pages_compress_two_to_four_and_random_ones_barely() {
        let g = PageGen::new(7, 20);
        let (mut text, mut random) = (0, 0);
        for i in 0..400 {
            let p = g.page(i);
            assert_eq!(*p, *g.page(i), "page {i} is the same each time");
            match g.kind(i) {
                PageKind::Text => {
                    text += 1;
                    for c in [CompressCodec::Zstd, CompressCodec::Lz4, CompressCodec::Lzo] {
                        let r = ratio(c, &p);
                        assert!(
                            (2.0..=4.0).contains(&r),
                            "text page {i}, {}: {r:.2}",
                            c.name()
                        );
                    }
                }
                PageKind::Random => {
                    random += 1;
                    for c in [CompressCodec::Zstd, CompressCodec::Lz4, CompressCodec::Lzo] {
                        let r = ratio(c, &p);
                        assert!(
                            (1.0..1.3).contains(&r),
                            "random page {i}, {}: {r:.2}",
                            c.name()
                        );
                    }
                }
            }
        }
        // 20% near-random, give or take the draw.
        assert!((50..110).contains(&random), "{random} near-random of 400");
        assert_eq!(text + random, 400);
        assert_ne!(*PageGen::new(8, 20).page(0), *g.page(0), "the seed matters");
        assert!((0..100).all(|i| PageGen::new(1, 0).kind(i) == PageKind::Text));
        assert!((0..100).all(|i| PageGen::new(1, 100).kind(i) == PageKind::Random));
    }

    #[test]
    fn summaries_use_nearest_rank() {
        let ns: Vec<u64> = (1..=100).rev().map(|x| x * 1000).collect();
        let s = summarize(&ns);
        assert_eq!(s.n, 100);
        assert_eq!(s.p50_us, 50.0);
        assert_eq!(s.p99_us, 99.0);
        assert!((s.mean_us - 50.5).abs() < 1e-9);
        assert_eq!(summarize(&[7000]).p99_us, 7.0);
        assert_eq!(summarize(&[]).n, 0);
        assert_eq!(summarize(&[1000, 3000]).p50_us, 1.0);
    }

    #[test]
    fn spreads_give_sample_sd_and_range() {
        let s = spread(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert!((s.mean - 5.0).abs() < 1e-12);
        assert!((s.sd - (32.0f64 / 7.0).sqrt()).abs() < 1e-12);
        assert_eq!((s.min, s.max), (2.0, 9.0));
        assert_eq!(spread(&[3.0]).sd, 0.0);
        assert_eq!(spread(&[]).mean, 0.0);
    }

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
