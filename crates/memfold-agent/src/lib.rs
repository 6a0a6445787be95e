//! # memfold-agent
//!
//! The agent inside QEMU: owns the userfaultfd on guest RAM and carries out the mapping
//! changes that only code in QEMU's address space can make.
//!
//! Built as `libmemfold_agent.so` and loaded with `LD_PRELOAD`: the library's constructor
//! starts the agent thread only when `MEMFOLD_SOCKET` is set ([`start_from_env`]); tests
//! run the same agent in-process with [`run`]. It waits for QEMU to map guest RAM (a
//! `memory-backend-memfd` of `MEMFOLD_RAM_BYTES`), registers it with userfaultfd for
//! missing, write-protect and minor faults, and attaches to memfoldd with the RAM memfd.
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
//!
//! **R and M bits for the NRU clock** (DE §4.2): memfoldd asks for a slice of guest RAM
//! at a time; the agent reports which pages were referenced and modified since the slice
//! was last armed, and arms it again: private pages are write-protected (a write faults:
//! M) and their PTEs zapped with `MADV_DONTNEED` (the memfd keeps the data; any access is
//! a minor fault: R). Minor faults are answered with `UFFDIO_CONTINUE`, write-protected
//! for reads so that a later write still shows.
//!
//! Crash safety: the agent, not memfoldd, serves every fault, from the pool memfd it holds
//! itself, so a guest keeps running correctly if memfoldd dies; the agent reconnects and
//! re-attaches (listing its shared pages) when memfoldd comes back. Stashed pages are
//! decoded from the store memfd the agent holds; before re-attaching, the agent writes
//! them all back into guest RAM, so a new memfoldd starts with a new, empty store.
//!
//! The agent's record of each page is where it lives: private, a reclaimed zero page, on
//! a pool frame, or stashed as a blob; every fault is served by that.
//!
//! | module | what |
//! |---|---|
//! | `config` | [`AgentConfig`] from the environment; finding guest RAM in this process |
//! | `state` | each page's home (`PageHome`) and its R and M bits |
//! | `fault` | the fault handler: by the faulting page's home (CoW break, refill, decode) |
//! | `requests` | memfoldd's requests (share, reclaim, stash, move, clock scan) and replies |
//! | `install` | mapping pool frames over guest pages (`mremap`, `EVENT_REMAP`) and back |
//! | `attach` | connecting, the hello and re-attach list, the welcome, the reports |

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use memfold_ids::Gfn;
use memfold_sys::memfd::punch_hole;
use memfold_sys::uffd::{self, Event, Uffd};
use memfold_wire::Conn;

mod attach;
mod config;
mod fault;
mod install;
mod requests;
mod state;

pub use config::AgentConfig;

use attach::{Counters, Pending};
use install::Remapper;
use state::Pages;

/// Bytes in a guest page and a pool frame.
const PAGE: u64 = 4096;
/// Guest RAM (and pages given back to it) is registered for all three fault kinds.
const RAM_MODE: u64 = uffd::MODE_MISSING | uffd::MODE_WP | uffd::MODE_MINOR;

/// Starts the agent thread if the environment asks for it. Its log goes to stderr
/// (QEMU's log), each line naming `memfold-agent`; after an error the guest runs on
/// unmanaged.
pub fn start_from_env() {
    let Some(cfg) = AgentConfig::from_env() else {
        return;
    };
    // QEMU is C: nothing else in its process installs a subscriber.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(true)
        .try_init();
    let _ = std::thread::Builder::new()
        .name("memfold-agent".into())
        .spawn(move || {
            let ended = std::panic::catch_unwind(|| run(cfg));
            if REGISTERED.load(std::sync::atomic::Ordering::SeqCst) {
                // The userfaultfd closes with this thread: write-protection, which keeps
                // the guest's writes out of shared pool frames, would be gone.
                fail_closed(&format!("the agent thread ended: {ended:?}"));
            }
            if let Ok(Err(e)) = ended {
                tracing::error!("guest left unmanaged: {e}");
            }
        });
}

/// Set once guest RAM is registered with the agent's userfaultfd: from then on the agent
/// must outlive the guest.
static REGISTERED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Fails closed: logs why and aborts the QEMU process, so that no guest runs on without
/// the agent's protection (a shared frame written through, a fault never served). The
/// guest's RAM stays in its memfd; nothing another guest holds is touched.
pub(crate) fn fail_closed(why: &str) -> ! {
    tracing::error!("failing closed, aborting QEMU: {why}");
    // Straight to stderr too: the last line of QEMU's log, subscriber or not.
    eprintln!("memfold-agent: failing closed, aborting QEMU: {why}");
    std::process::abort()
}

extern "C" fn memfold_agent_init() {
    start_from_env();
}

/// Runs at load time, like a C `__attribute__((constructor))`: QEMU preloads the library
/// and the agent starts (inert unless `MEMFOLD_SOCKET` is set).
#[used]
#[unsafe(link_section = ".init_array")]
static INIT: extern "C" fn() = memfold_agent_init;

/// The agent: guest RAM, its userfaultfd, where each page lives, and the connection to
/// memfoldd.
struct Agent {
    cfg: AgentConfig,
    /// Address of guest RAM in this process.
    base: u64,
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
    last_connect: Option<Instant>,
    /// State changes made serving faults, not yet reported.
    pending: Pending,
    counters: Counters,
    /// Faults read while a share was in progress, handled after it.
    deferred: Vec<Event>,
    remapper: Remapper,
    /// Most mappings (VMAs) shares may bring this process to.
    vma_budget: usize,
}

/// Runs the agent until the process exits.
///
/// Errors: guest RAM never appeared, or userfaultfd is unavailable. Once attached, the
/// agent never returns while QEMU lives: losing memfoldd only makes it reconnect.
pub fn run(cfg: AgentConfig) -> io::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let (base, memfd) = loop {
        if let Some(found) = config::find_ram(cfg.ram_bytes)? {
            break found;
        }
        if Instant::now() > deadline {
            return Err(io::Error::other(format!(
                "no shared memfd mapping of {} bytes (guest RAM) appeared in 120 s; QEMU needs memory-backend-memfd,share=on",
                cfg.ram_bytes
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let uffd = Uffd::open(
        uffd::FEATURE_EVENT_REMAP
            | uffd::FEATURE_MISSING_SHMEM
            | uffd::FEATURE_WP_SHMEM
            | uffd::FEATURE_MINOR_SHMEM
            | uffd::FEATURE_THREAD_ID,
    )?;
    // SAFETY: guest RAM is QEMU's shared memfd mapping, which this process touches only
    // through raw addresses (QEMU's vCPUs and devices), never through Rust references; the
    // agent thread that answers its faults never touches it through the mapping.
    unsafe { uffd.register(base, cfg.ram_bytes, RAM_MODE) }?;
    REGISTERED.store(true, std::sync::atomic::Ordering::SeqCst);
    let max_maps: usize = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(65530);
    let pages = (cfg.ram_bytes / PAGE) as usize;
    // Leave QEMU room for its own mappings (threads, libraries, TCG buffers).
    let vma_budget = cfg.vma_budget.unwrap_or(max_maps.saturating_sub(4096));
    let mut agent = Agent {
        cfg,
        base,
        memfd,
        uffd,
        pool: None,
        store: None,
        swap: None,
        pages: Pages::new(pages),
        conn: None,
        last_connect: None,
        pending: Pending::default(),
        counters: Counters::new(),
        deferred: Vec::new(),
        remapper: Remapper::new()?,
        vma_budget,
    };
    agent.serve()
}

impl Agent {
    /// The agent's loop: (re)attach when detached, serve faults, carry out requests,
    /// report. Returns only if polling fails.
    fn serve(&mut self) -> io::Result<()> {
        loop {
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
                fds.push(libc::pollfd {
                    fd: c.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                });
            }
            // SAFETY: polls a valid array of pollfd that lives across the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 200) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            while let Some(ev) = self.uffd.read_event()? {
                self.handle_or_retry(ev);
            }
            if fds.len() > 1 && fds[1].revents != 0 {
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

    /// Address of page `gfn` in this process.
    fn page_addr(&self, gfn: Gfn) -> u64 {
        self.base + gfn.offset()
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
