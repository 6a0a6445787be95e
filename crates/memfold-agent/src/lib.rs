//! # memfold-agent
//!
//! The agent inside QEMU: owns the userfaultfd on guest RAM and carries out the mapping
//! changes that only code in QEMU's address space can make.
//!
//! Built as `libmemfold_agent.so` and loaded with `LD_PRELOAD`: the library's constructor
//! starts the agent thread only when `MEMFOLD_SOCKET` is set ([`start_from_env`]); tests
//! run the same agent in-process with [`run`]. It waits for QEMU to map guest RAM (every
//! shared `memory-backend-memfd`, found without being told a size: `regions`), registers
//! each region with userfaultfd for the faults it serves (below), and attaches each to
//! memfoldd with its memfd (one agent per region, `NAME` or `NAME/ramK`). RAM that is not
//! shareable (QEMU's anonymous `-m`, a private memfd, huge pages, a file) is left alone
//! with one log line naming what to add ([`qemu_args`]).
//! It speaks `memfold-wire`'s protocol and reaches the OS through `memfold-sys`; it
//! decodes stashed pages with `memfold-codecs`. It knows nothing of memfoldd's engine.
//!
//! **Share** (ESX §4.3 "mapped read-only onto a frame shared copy-on-write"): for a run of
//! guest pages and pool frames, write-protect the guest pages (writers now wait), compare
//! their bytes (pread of the memfd: reading through the mapping would fault) with the pool
//! frames, map the equal ones: the pool frames are mapped at a staging address, registered
//! and write-protected there, then moved over the guest pages with `mremap`. With
//! `UFFD_FEATURE_EVENT_REMAP` the moved mapping keeps its registration and protected PTEs,
//! so no writer ever sees an unprotected shared page. The guest memfd's copies are then
//! punched out: that is the host memory freed.
//!
//! **CoW break** (ESX §4.3, DE §3.1): a write fault on a shared page copies the frame into
//! the guest memfd, maps the guest memfd back over the page, registers it and wakes the
//! writer. Every writer takes this path: vCPU stores, and the kernel's writes on QEMU's
//! behalf (disk reads into guest RAM), because the userfaultfd is not user-mode-only.
//!
//! **Zero pages** (ESX §4.3) are reclaimed rather than shared: write-protect, check they
//! are still zero, punch them out of the guest memfd, unprotect. The next access faults
//! as missing and the agent fills a zero page (`UFFDIO_ZEROPAGE`). This costs no frame and
//! no mapping (no VMA), and a guest that never touches its free pages again never pays.
//! Guest RAM is registered for missing faults too, so first touches of never-used RAM
//! also pass through the agent (served with a zero page, as the kernel would).
//!
//! **Stashed pages** (Difference Engine §3.2 patches, §3.3 compressed pages, §4.1): memfoldd
//! writes a cold page's patch or compressed form into the store memfd and asks the agent
//! to stash the page: under write-protection the agent decodes the blob and compares it
//! with the page's bytes, and only if equal punches the page out of the guest memfd. The
//! next access faults as missing; the agent decodes the page again (a patch against its
//! pool frame, which no guest can write) and installs it with `UFFDIO_COPY`. Swapped pages
//! (DE §4.6) are the same with the blob (patch, compressed or raw page) in the swap file,
//! which the agent also holds; it reads them back without keeping them in the page cache.
//! A page shared without a mapping is stashed as the empty patch against its frame: the
//! agent keeps only the frame (4 bytes, no record, no checksum) and copies it back.
//!
//! **R and M bits for the NRU clock** (DE §4.2): memfoldd asks for a slice of guest RAM
//! at a time; the agent reports which pages were referenced and modified since the slice
//! was last armed, and arms it again: private pages are write-protected (a write faults:
//! M) and their PTEs zapped with `MADV_DONTNEED` (the memfd keeps the data): any access
//! is a minor fault, R, answered with `UFFDIO_CONTINUE` (write-protected for a read) or,
//! in the `pagemap` mode, the kernel's, read back (`rbits.rs`).
//!
//! Crash safety: the agent, not memfoldd, serves every fault, from the pool memfd it holds
//! itself, so a guest keeps running correctly if memfoldd dies; the agent reconnects and
//! re-attaches (listing its shared pages) when memfoldd comes back. Stashed pages are
//! decoded from the store memfd the agent holds; before re-attaching, the agent writes
//! them all back into guest RAM, so a new memfoldd starts with a new, empty store.
//!
//! **Failing closed**: when the agent cannot serve a fault (a stored page that fails its
//! checksum or was written outside QEMU's mapping, a fault still failing after 30 s, the agent's loop ending or panicking), no
//! guest may run on without its protection. By default (`MEMFOLD_FAIL=pause`) the agent
//! stops the whole QEMU process with `SIGSTOP`, keeping the userfaultfd and guest RAM
//! mapped: the VM is paused with its data intact, for the operator to inspect (`gcore`,
//! `/proc/PID/mem`) or end (`kill -9`); one log line says what failed and how.
//! `MEMFOLD_FAIL=abort` aborts QEMU instead. Every path that gets there is listed at
//! `fail_closed`.
//!
//! **Discarded pages** (a balloon inflating, free page reporting, virtio-mem): QEMU punches
//! the range out of guest RAM's memfd and drops its mapping with `MADV_DONTNEED`, which
//! the kernel reports (`UFFD_EVENT_REMOVE`). Whatever memfold held there is let go, as
//! KSM unmerges a range dropped with `MADV_DONTNEED`: a page on a pool frame gets guest
//! RAM's memfd (now a hole) mapped back, a reclaimed or stashed page becomes a plain hole;
//! each reads as zeros, as it would without memfold, and memfoldd is told
//! (`ToDaemon::Discarded`) so the frame's reference or the blob is released. The agent's
//! own `MADV_DONTNEED` (arming the clock, on private pages only) runs on the helper
//! thread, since the caller waits until the event is read.
//!
//! The agent's record of each page is where it lives: private, a reclaimed zero page, on
//! a pool frame, or stashed as a blob; every fault is served by that.
//!
//! | module | what |
//! |---|---|
//! | `config` | [`AgentConfig`] (with [`FailMode`]) from the environment |
//! | `regions` | finding guest RAM's regions in this process, one agent each, and hot-plugged ones; the invariant that a fault or request touches one region only |
//! | [`qemu_args`] | QEMU's command line: which backends are guest RAM, and the fix for RAM memfold cannot share |
//! | `state` | each page's home (`PageHome`) and its R and M bits |
//! | `vmas` | the VMA budget of shares, for the whole process (all its regions): mappings and pages on frames |
//! | `discard` | ranges QEMU discarded (`UFFD_EVENT_REMOVE`): what memfold held there let go |
//! | `fault` | the fault handler: by the faulting page's home (CoW break, refill, decode) |
//! | `requests` | memfoldd's requests (share, reclaim, stash, move, clock scan) and replies |
//! | `install` | mapping pool frames over guest pages (`mremap`, `EVENT_REMAP`) and back |
//! | `attach` | connecting, the hello and re-attach list, the welcome, the reports |
//! | `ram_sends` | `sendmsg` interposed: guest RAM's memfd sent to no process but memfold-blk while managed |

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use memfold_ids::Gfn;
use memfold_sys::memfd::punch_hole;
use memfold_sys::uffd::{self, Event, Uffd};
use memfold_wire::Conn;

mod attach;
mod config;
mod discard;
mod discover;
mod fault;
pub mod fence;
mod install;
mod nocopy;
mod pageout;
pub mod qemu_args;
mod ram_sends;
mod rbits;
mod regions;
mod requests;
mod state;
mod unplug;
mod vmas;

pub use config::{AgentConfig, ClockRBits, ConfigError, FailMode, PAGEMAP_CLOCK_LOG};

use attach::{Counters, Pending};
use discover::{discover, qemu_plan};
use install::Remapper;
use regions::{GoneFlag, Watch};
use state::Pages;

/// Bytes in a guest page and a pool frame.
const PAGE: u64 = 4096;
/// Starts the agent thread if the environment asks for it (once per process: the
/// library's constructor calls it, and a host program may too). Its log goes to stderr
/// (QEMU's log), each line naming `memfold-agent`. If the agent cannot start (no guest
/// RAM, no userfaultfd, a bad `MEMFOLD_FAIL`) the guest runs on unmanaged; once it
/// manages guest RAM it never ends but by failing closed ([`run`]).
pub fn start_from_env() {
    static STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    // QEMU is C: nothing else in its process installs a subscriber.
    let logger = || {
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .with_target(true)
            .try_init();
    };
    let cfg = match AgentConfig::from_env() {
        Ok(Some(cfg)) => cfg,
        Ok(None) => return,
        Err(e) => {
            logger();
            tracing::error!("{e}; the agent does not start, the guest runs unmanaged");
            return;
        }
    };
    if STARTED.swap(true, std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    logger();
    // Before QEMU's main: no device can connect before the fence exists (`fence`).
    let _ = fence::write_fence();
    let _ = std::thread::Builder::new()
        .name("memfold-agent".into())
        .spawn(move || {
            // `run` catches panics once guest RAM is registered; this one is from before:
            // nothing is registered, so the guest runs on unmanaged.
            match std::panic::catch_unwind(|| run(cfg)) {
                Ok(Err(e)) => tracing::error!("guest left unmanaged: {e}"),
                Err(p) => tracing::error!(
                    "guest left unmanaged: the agent panicked: {}",
                    panic_text(&*p)
                ),
            }
        });
}

/// A panic's message.
fn panic_text(p: &(dyn std::any::Any + Send)) -> &str {
    p.downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// Fails closed: no guest runs on without the agent's protection (a shared frame written
/// through, a stale or corrupt page read, a fault never served). Never returns, so the
/// caller, the agent thread, keeps holding the userfaultfd and the descriptors and
/// mappings of guest RAM: write-protection and missing pages stay in force whatever
/// happens next. Nothing another guest holds is touched.
///
/// What it does is `mode` (`MEMFOLD_FAIL`):
///
/// - [`FailMode::Pause`] (the default): `SIGSTOP`, raised on the agent thread, stops
///   every thread of QEMU — vCPUs, the main loop, I/O threads — with guest RAM mapped
///   and its memfd open, for the operator to inspect (`gcore PID`, `/proc/PID/mem`) or
///   end (`kill -9 PID`; `kill -ABRT PID; kill -CONT PID` for a core dump). A `SIGCONT`
///   alone only stops it again (logged): the fault that failed is still unserved. If
///   the stop itself fails, QEMU is aborted.
/// - [`FailMode::Abort`]: QEMU aborts (`SIGABRT`); the guest is gone.
///
/// Why not QMP `stop`, which would pause only the vCPUs: the agent has no QMP channel.
/// The monitor socket is QEMU's own, set on its command line and normally held by the
/// manager (libvirt keeps the one connection); the agent could only guess it from
/// `/proc/self/cmdline`. And QMP commands are carried out by QEMU's main loop thread,
/// which may be the very thread waiting on the fault the agent cannot serve (device
/// emulation touching guest RAM), so the `stop` would never happen. QEMU's `vm_stop` is
/// not an exported symbol a preloaded library could call. A signal needs nothing from
/// QEMU and stops its own threads too, which a QMP `stop` leaves running against RAM.
///
/// Reached on every path where the agent cannot go on serving faults:
///
/// - a fault still failing after [`fault::FAULT_GIVE_UP`] (30 s) of retries: the host
///   out of memory (`ENOMEM` from `UFFDIO_COPY`/`ZEROPAGE`/`CONTINUE`, or the CoW
///   break's copy), `EIO` or any other error from a userfaultfd ioctl, or the VMA limit
///   (vm.max_map_count) when a CoW break maps the guest memfd back over one page of a
///   pool mapping (`fault.rs`, `handle_or_retry`);
/// - at once, a stashed page whose blob does not decode to the page's checksum (a
///   corrupt store or swap file, or a changed reference frame: a retry reads the same);
/// - at once, a fault on a stashed page whose hole in guest RAM's memfd was filled
///   outside QEMU's mapping (`pwrite`, a second mapping: a vhost-user backend): neither
///   the stored page nor the memfd's bytes are what the guest wrote, and a wake would
///   only bring the fault back forever (`fault.rs`);
/// - the agent's loop ending with an error (polling or reading the userfaultfd) or a
///   panic on the agent thread, once guest RAM is registered ([`run`] catches both
///   with the agent still alive);
/// - the remap helper thread gone in the middle of a move, so that whether pool frames
///   now back guest pages is unknown (`install.rs`).
///
/// Not on these: an error carrying out one of memfoldd's requests (its pages stay as
/// they were, or private and write-protected, and the next write is served; the agent
/// drops the connection and re-attaches), or before guest RAM is registered (nothing
/// to protect: the guest runs unmanaged).
///
/// `ram` is this process's descriptor of guest RAM's memfd, named in the log line: pages
/// not mapped now (stashed, reclaimed, or unmapped by the clock) read as `EIO` through
/// `/proc/PID/mem`, while the memfd holds every page that is in RAM.
fn fail_closed(mode: FailMode, why: &str, ram: RawFd) -> ! {
    let pid = rustix::process::getpid();
    if mode == FailMode::Abort {
        log_line(&format!("failing closed, aborting QEMU (pid {pid}): {why}"));
        std::process::abort()
    }
    log_line(&format!(
        "failing closed: {why}. VM PAUSED: QEMU pid {pid} is stopped (SIGSTOP) with guest RAM mapped and intact; inspect it with `gcore {pid}`, /proc/{pid}/mem or guest RAM's memfd /proc/{pid}/fd/{ram}; end it with `kill -9 {pid}` (SIGCONT stops it again; MEMFOLD_FAIL=abort aborts instead of pausing)"
    ));
    loop {
        // To this thread, not kill(getpid()): another thread may take a process-directed
        // signal, and this one would run on until the group stop reached it. A stop
        // signal stops the whole process whichever thread takes it.
        // SAFETY: raise only sends a signal; SIGSTOP has no handler to run.
        if unsafe { libc::raise(libc::SIGSTOP) } != 0 {
            let e = io::Error::last_os_error();
            log_line(&format!(
                "cannot stop QEMU (pid {pid}): {e}; aborting it instead ({why})"
            ));
            std::process::abort()
        }
        // Here only once the process is continued (or a tracer swallowed the stop).
        log_line(&format!(
            "QEMU pid {pid} was continued, but the agent failed closed ({why}): stopping it again; `kill -9 {pid}` ends it"
        ));
    }
}

/// Logs an error line of failing closed, and writes it straight to stderr too: the last
/// line of QEMU's log, subscriber or not. Never panics: failing closed must not unwind
/// (stderr may be closed, a subscriber may panic).
fn log_line(line: &str) {
    use std::io::Write;
    let _ = std::panic::catch_unwind(|| tracing::error!("{line}"));
    let _ = writeln!(std::io::stderr(), "memfold-agent: {line}");
}

extern "C" fn memfold_agent_init() {
    start_from_env();
}

/// Runs at load time, like a C `__attribute__((constructor))`: QEMU preloads the library
/// and the agent starts (inert unless `MEMFOLD_SOCKET` is set).
#[used]
// SAFETY: `.init_array` holds `extern "C" fn()` pointers the loader calls once, with no
// arguments, before `main`; `INIT` is one such, and what it runs needs nothing `main`
// sets up (it reads the environment, makes the write fence, starts the agent's thread).
#[unsafe(link_section = ".init_array")]
static INIT: extern "C" fn() = memfold_agent_init;

/// The agent: guest RAM, its userfaultfd, where each page lives, and the connection to
/// memfoldd.
struct Agent {
    cfg: AgentConfig,
    /// Address of this agent's guest RAM region in this process.
    base: u64,
    /// Length of the region, bytes: its pages are gfns `0 .. ram_bytes / 4096`
    /// (the invariant in `regions.rs`: nothing outside `[base, base + ram_bytes)`).
    ram_bytes: u64,
    /// Set by the watcher when the region is unmapped (hot-unplug): the agent detaches.
    gone: GoneFlag,
    /// The region's gate: the agent maps into it only while holding it (`unplug.rs`).
    managed: unplug::Managed,
    /// The guest RAM memfd.
    memfd: OwnedFd,
    uffd: Uffd,
    /// The pool memfd (shared frames, patch references), from memfoldd's welcome.
    pool: Option<OwnedFd>,
    /// The store memfd holding the blobs of stashed pages.
    store: Option<OwnedFd>,
    /// The swap file holding the blobs of swapped pages (DE §4.6), if memfoldd swaps.
    swap: Option<OwnedFd>,
    /// Where each page lives, and its R and M bits.
    pages: Pages,
    conn: Option<Conn>,
    /// Messages for memfoldd waiting for room in its socket, in order (`attach.rs`).
    outgoing: std::collections::VecDeque<memfold_wire::ToDaemon>,
    last_connect: Option<Instant>,
    /// Attaches in a row whose connection closed before any answer (`attach.rs`).
    closes_in_a_row: u32,
    /// State changes made serving faults, not yet reported.
    pending: Pending,
    counters: Counters,
    /// Faults read while a share was in progress, handled after it.
    deferred: Vec<Event>,
    remapper: Remapper,
    /// Most mappings (VMAs) shares may bring this process to (all its regions together:
    /// `vmas.rs`), following `vm.max_map_count` as it changes.
    vma_budget: vmas::Budget,
    /// The operator opted this guest out (memfoldd's `ToAgent::OptedOut`); carried to a
    /// restarted memfoldd in the hello.
    opted_out: bool,
    /// The page tables' reader in the clock's `pagemap` mode (`rbits.rs`).
    rbits: Option<memfold_sys::pagemap::Pagemap>,
    /// Which pages of the slice the clock scan in progress found mapped, read with its R
    /// bits in the `pagemap` mode (`rbits.rs`): the scan's zap of pages on frames skips
    /// runs with none mapped.
    mapped_at_scan: Option<rbits::Mapped>,
    /// The read-only window onto guest RAM's memfd that pages go to the kernel's swap
    /// through (`pageout.rs`), made at the first page-out.
    window: Option<memfold_sys::pageout::PageOutWindow>,
    /// The last CoW break a fault asked for (or the far end of the last break ahead) and
    /// when: two in adjacent pages close together are a sequential writer
    /// ([`fault::BREAK_AHEAD`]).
    last_break: Option<(Gfn, Instant)>,
}

/// Runs the agent until the process exits: finds guest RAM (every region, `regions`),
/// runs one agent per region — the first on this thread, the others on threads of their
/// own — and, when the regions are QEMU's memory backends, a watcher for regions plugged
/// or unplugged later.
///
/// Guest RAM is found without being told its size: every shared memfd QEMU made for a
/// `memory-backend-memfd`, once as many as QEMU's command line defines are mapped (or,
/// without a command line to read, once none has appeared for `discover::SETTLE`).
/// `cfg.ram_bytes`, if not 0, is a check: the regions must add up to it (or, for a host
/// program that maps its own memfd, one shared memfd mapping of exactly that size is
/// taken, whatever its name); if none does within 120 s, the error names what was found.
///
/// Errors (the guest, or that part of it, runs on unmanaged, logged by the caller in one
/// line): QEMU's command line says no guest RAM is shareable (the line names what to
/// add: `memfold_agent::qemu_args`); no guest RAM region appeared in 120 s, or not
/// those `cfg.ram_bytes` asks for (the line names what was found); userfaultfd is
/// unavailable. Once a region is registered, its agent never returns but by failing closed
/// (`cfg.on_failure`) with the agent, its userfaultfd and guest RAM's descriptors still
/// held — except when its region is unmapped (hot-unplug), when it detaches and returns
/// an error saying so.
pub fn run(cfg: AgentConfig) -> io::Result<std::convert::Infallible> {
    if fence::write_fence().is_none() {
        return Err(io::Error::other(
            "the write fence cannot be made, so devices' writes could be lost: memfold leaves this guest alone",
        ));
    }
    let plan = qemu_plan().map_err(|e| {
        io::Error::other(format!(
            "QEMU's command line: {e}; without it memfold cannot tell whether QEMU reads disks beyond the write fence, so it leaves this guest alone"
        ))
    })?;
    if let Some(plan) = &plan {
        let problems: Vec<String> = plan.problems().iter().map(|p| p.to_string()).collect();
        if !plan.any_shareable_ram() {
            return Err(discover::not_shareable(&problems));
        }
        if !plan.unfenced_io.is_empty() {
            return Err(io::Error::other(format!(
                "QEMU reads disks straight into guest RAM after the submitting call returns ({}), which memfold's write fence cannot cover: a read racing a share could be lost, so memfold leaves this guest alone (use aio=threads, QEMU's default)",
                plan.unfenced_io.join("; ")
            )));
        }
        if !plan.outside_writers.is_empty() {
            return Err(io::Error::other(format!(
                "a back end writes guest RAM outside QEMU's page tables ({}): its writes under a shared page would be lost, and a page reclaimed under it written where the guest no longer reads, so memfold leaves this guest alone (docs/security.md)",
                plan.outside_writers.join("; ")
            )));
        }
        if !problems.is_empty() {
            tracing::warn!(
                "part of guest RAM is not shareable and is left alone: {}",
                problems.join("; ")
            );
        }
        if let Some(user) = &plan.runs_as {
            tracing::info!("QEMU runs as {user} once set up: attaching only after that");
            attach::expect_user_switch(user);
        }
    }
    let expected = plan.as_ref().map(|p| p.shareable_backends());
    let (found, by_name) = discover(&cfg, expected)?;
    let many = found.len() > 1;
    let watch = std::sync::Arc::new(Watch::new(cfg.clone(), found.len().max(1)));
    let mut first = None;
    for (i, region) in found.into_iter().enumerate() {
        let mut rcfg = cfg.clone();
        if many {
            rcfg.name = format!("{}/ram{i}", cfg.name);
        }
        let gone = watch.add(&region);
        tracing::info!(
            "guest RAM region {}: {} MiB at {:#x}",
            rcfg.name,
            region.bytes >> 20,
            region.base
        );
        if first.is_none() {
            first = Some((rcfg, region, gone));
        } else {
            spawn_region(rcfg, region, gone);
        }
    }
    if by_name {
        let w = std::sync::Arc::clone(&watch);
        let _ = std::thread::Builder::new()
            .name("memfold-watch".into())
            .spawn(move || w.watch());
    }
    let (rcfg, region, gone) = first.ok_or_else(|| io::Error::other("no guest RAM region"))?;
    run_region(rcfg, region, gone)
}

/// Runs the agent of `region` on a thread of its own; logs why if it ends.
pub(crate) fn spawn_region(cfg: AgentConfig, region: regions::Region, gone: GoneFlag) {
    let name = cfg.name.clone();
    let spawned = std::thread::Builder::new()
        .name("memfold-agent".into())
        .spawn(move || {
            let name = cfg.name.clone();
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run_region(cfg, region, gone)
            })) {
                Ok(Err(e)) => tracing::error!("guest RAM region {name} left unmanaged: {e}"),
                Err(p) => tracing::error!(
                    "guest RAM region {name} left unmanaged: the agent panicked: {}",
                    panic_text(&*p)
                ),
            }
        });
    if let Err(e) = spawned {
        tracing::error!("guest RAM region {name} left unmanaged: no thread: {e}");
    }
}

/// Runs the agent of one guest RAM region until the process exits ([`run`]).
///
/// Errors: the region has 2^29 pages (2 TiB) or more, past what the page table packs
/// ([`state::MAX_FRAME`]); userfaultfd is unavailable or cannot register the region (it
/// runs on unmanaged); the region was unmapped (hot-unplug: the agent detaches).
fn run_region(
    cfg: AgentConfig,
    region: regions::Region,
    gone: GoneFlag,
) -> io::Result<std::convert::Infallible> {
    let regions::Region {
        base, bytes, memfd, ..
    } = region;
    // Everything that can fail comes before registering: afterwards only failing closed.
    let pages = (bytes / PAGE) as usize;
    if pages >= state::MAX_FRAME as usize {
        return Err(io::Error::other(format!(
            "a region of {pages} pages: the agent's page table holds fewer than {}",
            state::MAX_FRAME
        )));
    }
    let remapper = Remapper::new()?;
    let uffd = Uffd::open(uffd::AGENT_FEATURES)?;
    let rbits = rbits::reader(cfg.clock_rbits, base, &cfg.name);
    let ram_id = memfold_sys::memfd::file_id(memfd.as_fd())?;
    // This thread's sends of the memfd are its hellos; any other thread's go to
    // memfold-blk or nowhere while the region is managed (`ram_sends`).
    ram_sends::mark_agent_thread();
    let _managed = ram_sends::manage(ram_id, &cfg.name);
    let managed = unplug::manage(base, bytes, std::sync::Arc::clone(&gone))?;
    managed.register(&uffd, rbits::ram_mode(rbits.as_ref()), memfd.as_fd())?;
    // Leave QEMU room for its own mappings (threads, libraries, TCG buffers). The count
    // of mappings it is checked against is the whole process's (`vmas::PROCESS`), so the
    // agents of several regions share one budget.
    let vma_budget = vmas::Budget::new(
        cfg.vma_budget,
        memfold_sys::max_map_count::read,
        vmas::MAPS_STALE,
    );
    let mut agent = Agent {
        cfg,
        base,
        ram_bytes: bytes,
        gone,
        managed,
        memfd,
        uffd,
        pool: None,
        store: None,
        swap: None,
        pages: Pages::new(pages),
        conn: None,
        outgoing: Default::default(),
        last_connect: None,
        closes_in_a_row: 0,
        pending: Pending::default(),
        counters: Counters::new(),
        deferred: Vec::new(),
        remapper,
        vma_budget,
        opted_out: false,
        rbits,
        mapped_at_scan: None,
        window: None,
        last_break: None,
    };
    // A panic unwinds to here, not past: `agent` (the userfaultfd, guest RAM's memfd, the
    // pool) must outlive failing closed, or write-protection would be gone.
    let why = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| agent.serve())) {
        Ok(e) if agent.gone.load(std::sync::atomic::Ordering::SeqCst) => {
            // Once nothing of it is mapped, memfoldd is told why the connection closes: a
            // region released, not a QEMU gone (it checks /proc too); best effort.
            agent.await_unmapped();
            agent.send_to_memfoldd(memfold_wire::ToDaemon::RegionUnmapped);
            return Err(io::Error::other(format!(
                "guest RAM region {} was unmapped (hot-unplug): detached ({e})",
                agent.cfg.name
            )));
        }
        Ok(e) => format!("the agent's loop ended: {e}"),
        Err(p) => format!("the agent thread panicked: {}", panic_text(&*p)),
    };
    agent.fail_closed(&why)
}

impl Agent {
    /// The agent's loop: (re)attach when detached, serve faults, carry out requests,
    /// report. Returns only if polling or reading the userfaultfd fails.
    fn serve(&mut self) -> io::Error {
        loop {
            if self.gone.load(std::sync::atomic::Ordering::SeqCst) {
                return io::Error::other("the region is no longer mapped");
            }
            if self.conn.is_none()
                && self
                    .last_connect
                    .is_none_or(|t| t.elapsed() > Duration::from_secs(1))
            {
                self.last_connect = Some(Instant::now());
                self.attach();
            }
            let mut fds = vec![libc::pollfd {
                fd: self.uffd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            if let Some(c) = &self.conn {
                // Room in memfoldd's socket, too, while messages wait for it.
                let out = if self.behind() { libc::POLLOUT } else { 0 };
                fds.push(libc::pollfd {
                    fd: c.as_raw_fd(),
                    events: libc::POLLIN | out,
                    revents: 0,
                });
            }
            // Events an ioctl read into the backlog do not make the fd readable.
            let wait = if self.uffd.has_backlog() { 0 } else { 200 };
            // SAFETY: polls a valid array of pollfd that lives across the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return e;
            }
            loop {
                match self.uffd.read_event() {
                    Ok(Some(ev)) => self.handle_or_retry(ev),
                    Ok(None) => break,
                    Err(e) => return e.into(),
                }
            }
            // A request (or the end): room to write alone is the flush's, at the turn's end.
            if fds.len() > 1 && fds[1].revents & !libc::POLLOUT != 0 {
                if let Err(e) = self.command() {
                    // The agent must keep serving faults whatever failed: drop the
                    // connection, the re-attach lists what is shared or reclaimed now.
                    tracing::warn!("request failed: {e}; re-attaching");
                    self.conn = None;
                }
            }
            // Faults read while a request was carried out (also after a failed one).
            for ev in std::mem::take(&mut self.deferred) {
                self.handle_or_retry(ev);
            }
            self.report();
        }
    }

    /// Fails closed as configured ([`fail_closed`]), holding on to the agent.
    fn fail_closed(&self, why: &str) -> ! {
        fail_closed(self.cfg.on_failure, why, self.memfd.as_raw_fd())
    }

    /// Address of page `gfn` in this process.
    fn page_addr(&self, gfn: Gfn) -> u64 {
        self.base + gfn.offset()
    }

    /// Lifts the write-protection of `len` bytes of guest RAM from `addr` (page-aligned):
    /// writes no longer fault, so the pages' watch bits go too (the discard's invariant,
    /// [`state::Pages::unwatch`]), and their M bits are set — a page the clock armed was
    /// mapped write-protected for its M, whose later writes are no longer seen (counted
    /// modified, as a page never armed is). Every unprotect of guest RAM goes through here.
    ///
    /// Errors: the userfaultfd call failed.
    fn unprotect(&mut self, addr: u64, len: u64) -> io::Result<()> {
        let first = Gfn(((addr - self.base) / PAGE) as u32);
        self.pages.unwatch(first, len.div_ceil(PAGE));
        self.pages.mark_modified(first, len.div_ceil(PAGE));
        Ok(self.uffd.write_protect(addr, len, false)?)
    }

    /// Frees `pages` pages of the guest memfd from `gfn` on (the caller made sure their
    /// bytes are kept elsewhere or are zero). Returns whether the kernel did.
    fn punch(&self, gfn: Gfn, pages: u64) -> bool {
        punch_hole(self.memfd.as_fd(), gfn.offset(), pages * PAGE)
    }

    /// The pool memfd.
    ///
    /// Errors: not attached yet (no pool).
    fn pool(&self) -> io::Result<BorrowedFd<'_>> {
        self.pool
            .as_ref()
            .map(|p| p.as_fd())
            .ok_or_else(|| io::Error::other("patch or share without a pool"))
    }
}
