//! What the in-process tests share: they play QEMU themselves. Guest RAM is a memfd
//! mapped shared (as QEMU's memory-backend-memfd makes it), the real agent serves it
//! from a thread, and memfoldd runs in another thread with a fast configuration.

// Each test file uses its own part of this module.
#![allow(dead_code)]

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use memfold_agent::{self as agent, AgentConfig, FailMode};
use memfold_core::{CompressCodec, EngineConfig, PatchCodec, Policy, ZeroPolicy};
use memfold_live::daemon::{self, DaemonConfig, DomainRule};
use memfold_live::query_stats;
use memfold_sys::memfd;
use memfold_wire::stats::{Stats, VmStats};
use rand::{rngs::SmallRng, Rng};

/// Bytes in a guest page.
pub const PAGE: usize = 4096;

/// memfoldd's engine for tests: full-speed scans every 0.1–0.4 s, zero pages reclaimed,
/// the Difference Engine policy with a 0.3 s clock (pages turn cold within a second),
/// cut-offs at half a page. Callers change what they test with struct update syntax.
pub fn fast_engine() -> EngineConfig {
    EngineConfig {
        rate: 0,
        zero: ZeroPolicy::Reclaim,
        min_scan_interval_us: 100_000,
        max_scan_interval_us: 400_000,
        clock_interval_us: Some(300_000),
        policy: Policy::difference_engine(),
        patch_codec: PatchCodec::RunDiff,
        patch_cutoff: 2048,
        compress_codec: CompressCodec::Zstd,
        ..EngineConfig::default()
    }
}

/// Starts memfoldd in a thread with [`daemon_config`], to run until the flag it returns is
/// set (as a killed memfoldd, its descriptors close); returns its socket once it answers,
/// the flag and the thread.
pub fn start_stoppable_memfoldd(
    dir: &Path,
    engine: EngineConfig,
) -> (
    PathBuf,
    Arc<AtomicBool>,
    JoinHandle<Result<(), daemon::DaemonError>>,
) {
    let cfg = daemon_config(dir, engine);
    let socket = cfg.socket.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let thread = std::thread::spawn(move || daemon::run_until(cfg, &flag));
    wait_for(&socket, Duration::from_secs(10), "memfoldd", |_| true);
    (socket, stop, thread)
}

/// The one place these tests build a [`DaemonConfig`]: its socket and swap live in `dir`.
pub fn daemon_config(dir: &Path, engine: EngineConfig) -> DaemonConfig {
    DaemonConfig {
        socket: dir.join("memfoldd.sock"),
        engine,
        swap_dir: dir.to_path_buf(),
        swap_capacity: 64 << 20,
        domains: DomainRule::User,
        agent_gid: None,
        never_share: Default::default(),
        claim: memfold_core::ClaimPolicy::Never,
        allowance: 0,
        guest_channels: None,
        tenant_max_bytes: u64::MAX,
    }
}

/// Starts memfoldd in a thread with [`daemon_config`]; returns its socket once it answers.
pub fn start_memfoldd(dir: &Path, engine: EngineConfig) -> PathBuf {
    start_memfoldd_with(daemon_config(dir, engine))
}

/// Starts memfoldd in a thread with `cfg`; returns its socket once it answers.
pub fn start_memfoldd_with(cfg: DaemonConfig) -> PathBuf {
    let socket = cfg.socket.clone();
    std::thread::spawn(move || daemon::run(cfg));
    let t = Instant::now();
    while query_stats(&socket).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "memfoldd did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    socket
}

/// Guest RAM: a memfd mapped shared. Never unmapped: the agent serves it until the
/// process exits.
pub struct GuestRam {
    /// This test's descriptor of the memfd (the agent finds and reopens it).
    pub fd: std::fs::File,
    /// Start of the mapping.
    pub ptr: *mut u8,
    /// Pages.
    pub pages: usize,
}

// SAFETY: the mapping lives as long as the process; the tests synchronise their own
// accesses to it (each through raw pointers or one thread at a time).
unsafe impl Send for GuestRam {}
// SAFETY: as above.
unsafe impl Sync for GuestRam {}

impl GuestRam {
    /// `pages` pages of RAM, all holes. The agent finds guest RAM by its size: tests that
    /// run in one process use different sizes.
    pub fn new(name: &str, pages: usize) -> GuestRam {
        let fd = memfd::create(name).unwrap();
        memfd::set_len(fd.as_fd(), (pages * PAGE) as u64).unwrap();
        // SAFETY: a new shared mapping of a memfd this test owns, at an address the
        // kernel picks; it is never unmapped.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        GuestRam {
            fd: fd.into(),
            ptr: ptr as *mut u8,
            pages,
        }
    }

    /// Bytes of guest RAM.
    pub fn bytes(&self) -> usize {
        self.pages * PAGE
    }

    /// Address of page `g`.
    pub fn page_ptr(&self, g: usize) -> *mut u8 {
        assert!(g < self.pages);
        // SAFETY: within the mapping.
        unsafe { self.ptr.add(g * PAGE) }
    }

    /// The memfd.
    pub fn memfd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Whether the memfd holds data (not a hole) at page `g`: a shared, reclaimed or
    /// stored page is a hole; a private one is not.
    pub fn has_data(&self, g: usize) -> bool {
        let g = memfold_ids::Gfn(g as u32);
        memfd::next_data_run(self.memfd(), g, memfold_ids::Gfn(g.0 + 1)).is_some()
    }

    /// Whether page `g` is mapped from memfoldd's pool (shared), not from the RAM memfd.
    pub fn on_pool(&self, g: usize) -> bool {
        let addr = self.page_ptr(g) as u64;
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines().any(|l| {
            let (a, b) = l
                .split_whitespace()
                .next()
                .unwrap()
                .split_once('-')
                .unwrap();
            let (a, b) = (
                u64::from_str_radix(a, 16).unwrap(),
                u64::from_str_radix(b, 16).unwrap(),
            );
            (a..b).contains(&addr) && l.contains("/memfd:memfold-pool")
        })
    }

    /// Copies page `g` out through the mapping, a word at a time with volatile reads (other
    /// threads may write it meanwhile; a seqlock says whether the copy is whole).
    pub fn read(&self, g: usize, out: &mut [u8]) {
        assert_eq!(out.len(), PAGE);
        let src = self.page_ptr(g) as *const u64;
        for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
            // SAFETY: an aligned word of the page.
            let w = unsafe { src.add(i).read_volatile() };
            chunk.copy_from_slice(&w.to_ne_bytes());
        }
    }

    /// Writes `bytes` at byte `off` of page `g` through the mapping (volatile: readers may
    /// copy it meanwhile).
    pub fn write(&self, g: usize, off: usize, bytes: &[u8]) {
        assert!(off + bytes.len() <= PAGE);
        let dst = self.page_ptr(g);
        if off % 8 == 0 && bytes.len() % 8 == 0 {
            for (i, chunk) in bytes.chunks_exact(8).enumerate() {
                let w = u64::from_ne_bytes(chunk.try_into().unwrap());
                // SAFETY: an aligned word of the page.
                unsafe { (dst.add(off) as *mut u64).add(i).write_volatile(w) };
            }
        } else {
            for (i, &b) in bytes.iter().enumerate() {
                // SAFETY: a byte of the page.
                unsafe { dst.add(off + i).write_volatile(b) };
            }
        }
    }
}

/// Starts the agent on `ram` in a thread, attached to memfoldd at `socket`, and waits
/// until memfoldd lists the guest.
pub fn start_agent(socket: &Path, name: &str, ram: &GuestRam) {
    start_agent_with_budget(socket, name, ram, None);
}

/// As [`start_agent`], with at most `vma_budget` mappings in this process (`None`: the
/// agent's default).
#[allow(dead_code)]
pub fn start_agent_with_budget(
    socket: &Path,
    name: &str,
    ram: &GuestRam,
    vma_budget: Option<usize>,
) {
    let cfg = AgentConfig {
        socket: socket.to_path_buf(),
        name: name.into(),
        ram_bytes: ram.bytes() as u64,
        vma_budget,
        // The agent runs in this test process: pausing would stop the test run for good.
        on_failure: FailMode::Abort,
        clock_rbits: memfold_agent::ClockRBits::Userfault,
    };
    // Named, so that a test can find the agent's thread in /proc (comm: 15 bytes).
    std::thread::Builder::new()
        .name(format!("agent-{name}"))
        .spawn(move || agent::run(cfg))
        .unwrap();
    let t = Instant::now();
    while !query_stats(socket).is_ok_and(|s| s.vms.iter().any(|v| v.name == name)) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the agent did not attach"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls memfoldd's statistics until `done` holds; panics with them after `limit`.
pub fn wait_for(
    socket: &Path,
    limit: Duration,
    what: &str,
    done: impl Fn(&Stats) -> bool,
) -> Stats {
    let t = Instant::now();
    loop {
        if let Ok(s) = query_stats(socket) {
            if done(&s) {
                return s;
            }
            assert!(t.elapsed() < limit, "{what}: not after {limit:?}: {s:#?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Fills every page of `ram` with data each mechanism takes
/// ([`memfold_core::sim::every_mechanism_pages`]: zeros, copies of one random page,
/// near-copies, text, random, by `g % 5`). Returns what each page holds.
pub fn fill_every_mechanism(ram: &GuestRam, seed: u64) -> Vec<Vec<u8>> {
    let want = memfold_core::sim::every_mechanism_pages(ram.pages, seed);
    for (g, p) in want.iter().enumerate() {
        ram.write(g, 0, p);
    }
    want
}

/// Guest `name` in memfoldd's statistics (attached or not).
///
/// Panics: memfoldd does not list it.
pub fn vm_named<'a>(s: &'a Stats, name: &str) -> &'a VmStats {
    s.vms
        .iter()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("memfoldd lists no guest {name:?}"))
}

/// Guest `name` if memfoldd lists it as attached now.
pub fn attached<'a>(s: &'a Stats, name: &str) -> Option<&'a VmStats> {
    s.vms.iter().find(|v| v.name == name && !v.detached)
}

/// Pages memfold holds of guest `v`: shared, reclaimed, patched or compressed.
pub fn managed(v: &VmStats) -> u64 {
    v.shared_pages + v.zero_reclaimed_pages + v.patched_pages + v.compressed_pages
}

/// Whether every mechanism holds some of guest `v`'s pages.
pub fn every_mechanism(v: &VmStats) -> bool {
    v.shared_pages > 0
        && v.zero_reclaimed_pages > 0
        && v.patched_pages > 0
        && v.compressed_pages > 0
}

/// A QEMU of our own (no agent: the test speaks the wire itself) says hello to memfoldd
/// at `socket` as guest `name`, its RAM a memfd named `memfd_name` holding `ram`.
/// Returns memfoldd's answer, the connection (kept open, a welcomed guest stays
/// attached), every descriptor memfoldd handed it (its pool first) and the RAM memfd.
pub fn hello_fake_qemu(
    socket: &Path,
    name: &str,
    memfd_name: &str,
    ram: &[u8],
) -> (
    memfold_wire::ToAgent,
    memfold_wire::Conn,
    Vec<std::os::fd::OwnedFd>,
    std::os::fd::OwnedFd,
) {
    use memfold_wire::{Conn, ToAgent, ToDaemon, PROTOCOL_VERSION};
    let fd = memfd::create(memfd_name).unwrap();
    memfd::set_len(fd.as_fd(), ram.len() as u64).unwrap();
    memfd::pwrite_all(fd.as_fd(), ram, 0).unwrap();
    let c = Conn::connect(socket).unwrap();
    let hello = ToDaemon::AgentHello {
        version: PROTOCOL_VERSION,
        name: name.into(),
        pid: std::process::id(),
        ram_bytes: ram.len() as u64,
        shared: 0,
        opted_out: false,
    };
    c.send(&hello, &[fd.as_fd()]).unwrap();
    c.set_recv_timeout(Duration::from_secs(5)).unwrap();
    let (reply, fds) = c.recv::<ToAgent>().unwrap().expect("an answer");
    (reply, c, fds, fd)
}

/// A QEMU of our own (no agent: the test speaks the wire itself): a RAM memfd holding
/// `ram`, attached to memfoldd at `socket` as guest `name`, which must be welcomed.
/// Returns the connection, every descriptor memfoldd handed it (its pool first) and the
/// RAM memfd.
pub fn attach_fake_qemu(
    socket: &Path,
    name: &str,
    ram: &[u8],
) -> (
    memfold_wire::Conn,
    Vec<std::os::fd::OwnedFd>,
    std::os::fd::OwnedFd,
) {
    let (reply, c, fds, fd) = hello_fake_qemu(socket, name, name, ram);
    assert!(
        matches!(reply, memfold_wire::ToAgent::Welcome { .. }),
        "{name} is managed: {reply:?}"
    );
    assert!(fds.len() >= 2, "{name}: a pool and a store");
    (c, fds, fd)
}

/// Two guests `a` (`pages_a`) and `b` (`pages_b`) of random pages (from `rng`), each
/// with its agent attached to the memfoldd at `socket` (waits until both are).
pub fn two_random_guests(
    socket: &Path,
    rng: &mut SmallRng,
    pages_a: usize,
    pages_b: usize,
) -> (GuestRam, GuestRam) {
    let (a, b) = (GuestRam::new("a", pages_a), GuestRam::new("b", pages_b));
    let mut page = vec![0u8; PAGE];
    for (ram, pages) in [(&a, pages_a), (&b, pages_b)] {
        for g in 0..pages {
            rng.fill(&mut page[..]);
            ram.write(g, 0, &page);
        }
    }
    start_agent(socket, "a", &a);
    start_agent(socket, "b", &b);
    wait_for(socket, Duration::from_secs(10), "both attached", |s| {
        s.vms.len() == 2
    });
    (a, b)
}

/// Guest RAM `ram`'s memfd as the wire names it (a block device's reports do).
pub fn ram_file(ram: &GuestRam) -> memfold_wire::RamFile {
    let (dev, ino) = memfd::file_id(ram.memfd()).unwrap();
    memfold_wire::RamFile { dev, ino }
}

/// Waits up to 10 s for `f`; fails naming `what`.
pub fn eventually(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(10), "never: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sharing alone, a scan of 1 page/s (so every share is one made at read), no clock, and
/// reads served from frames (Satori §5.2).
pub fn read_fill_engine() -> EngineConfig {
    EngineConfig {
        policy: Policy::sharing_only(),
        rate: 1,
        clock_interval_us: None,
        read_fill: true,
        ..fast_engine()
    }
}

/// A base image of `blocks` random 4 KiB blocks at `dir/base.img`: its path, its
/// blocks, and its id as devices name it.
pub fn random_base(
    dir: &Path,
    rng: &mut SmallRng,
    blocks: usize,
) -> (PathBuf, Vec<Vec<u8>>, memfold_ids::DiskId) {
    let path = dir.join("base.img");
    let base: Vec<Vec<u8>> = (0..blocks)
        .map(|_| {
            let mut p = vec![0u8; PAGE];
            rng.fill(&mut p[..]);
            p
        })
        .collect();
    std::fs::write(&path, base.concat()).unwrap();
    let id = memfold_ids::DiskId::of_metadata(&std::fs::metadata(&path).unwrap());
    (path, base, id)
}

/// A block device played through the wire (the real [`memfold_wire::LandedReporter`])
/// serving the base at `path`, of id `disk`, reporting to memfoldd at `socket`.
pub fn base_device(
    socket: &Path,
    path: &Path,
    disk: memfold_ids::DiskId,
) -> memfold_wire::LandedReporter {
    memfold_wire::LandedReporter::spawn_with_bases(
        socket,
        vec![(disk, std::fs::File::open(path).unwrap().into())],
    )
    .unwrap()
}

/// Guest `ram` reads the first `blocks` of `base` (of id `disk`) through `dev`, each block
/// twice, into pages `first + 10 k` and `first + 10 k + 1`: the pages written and
/// reported landed from their blocks (shared with each other, so the block is a
/// candidate for memfoldd to learn).
pub fn land_blocks(
    ram: &GuestRam,
    dev: &memfold_wire::LandedReporter,
    (base, disk): (&[Vec<u8>], memfold_ids::DiskId),
    first: usize,
    blocks: usize,
) {
    let (mut gfns, mut bases) = (Vec::new(), Vec::new());
    for (k, bytes) in base.iter().enumerate().take(blocks) {
        for copy in 0..2 {
            let g = first + 10 * k + copy;
            ram.write(g, 0, bytes);
            let block = memfold_ids::BaseBlock {
                disk,
                block: k as u64,
            };
            bases.push((gfns.len() as u32, block));
            gfns.push(memfold_ids::Gfn(g as u32));
        }
    }
    assert!(dev.report_from(ram_file(ram), gfns, bases));
}

/// This process's descriptor limit (`RLIMIT_NOFILE`): (soft, hard).
pub fn nofile() -> (u64, u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct it is given.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    (lim.rlim_cur, lim.rlim_max)
}

/// Sets this process's descriptor limit (`RLIMIT_NOFILE`) to `soft` and `hard`.
pub fn set_nofile(soft: u64, hard: u64) {
    let lim = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: a plain setrlimit with a valid struct.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
}
