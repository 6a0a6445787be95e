//! The agent inside QEMU: owns the userfaultfd on guest RAM and carries out the mapping
//! changes that only code in QEMU's address space can make.
//!
//! Loaded with `LD_PRELOAD` (crate `memfold-agent`); it starts only when `MEMFOLD_SOCKET`
//! is set. It waits for QEMU to map guest RAM (a `memory-backend-memfd` of
//! `MEMFOLD_RAM_BYTES`), registers it with userfaultfd for write-protect faults, and
//! attaches to memfoldd with the RAM memfd.
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

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::legacy::{self, PRIVATE, RECLAIMED, STASHED};
use memfold_core::Page;
use memfold_sys::memfd::{drop_cache, pread_exact, punch_hole, pwrite_all};
use memfold_sys::uffd::{self, Event, Uffd};
use memfold_wire::latency::OpLatency;
use memfold_wire::{
    reattach, AgentReport, BlobHome, Conn, Gfn, StashPage, ToAgent, ToDaemon, CLOCK_SLICE,
    PROTOCOL_VERSION,
};

const PAGE: u64 = 4096;
/// Guest RAM (and pages given back to it) is registered for all three fault kinds.
const RAM_MODE: u64 = uffd::MODE_MISSING | uffd::MODE_WP | uffd::MODE_MINOR;
/// How often the agent reports its counters and latencies.
const REPORT_EVERY: Duration = Duration::from_secs(1);

/// What the agent needs to know, from its environment.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// memfoldd's socket (`MEMFOLD_SOCKET`).
    pub socket: PathBuf,
    /// Guest name (`MEMFOLD_VM_NAME`).
    pub name: String,
    /// Guest RAM, bytes (`MEMFOLD_RAM_BYTES`).
    pub ram_bytes: u64,
    /// Most mappings (VMAs) the agent lets QEMU have (`MEMFOLD_VMA_BUDGET`); `None`:
    /// vm.max_map_count less 4096 left for QEMU's own mappings.
    pub vma_budget: Option<usize>,
}

impl AgentConfig {
    /// Reads the configuration from the environment; `None` when `MEMFOLD_SOCKET` is unset
    /// (the library is then inert).
    pub fn from_env() -> Option<AgentConfig> {
        let socket = std::env::var_os("MEMFOLD_SOCKET")?;
        Some(AgentConfig {
            socket: socket.into(),
            name: std::env::var("MEMFOLD_VM_NAME").unwrap_or_else(|_| "guest".into()),
            ram_bytes: std::env::var("MEMFOLD_RAM_BYTES")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            vma_budget: std::env::var("MEMFOLD_VMA_BUDGET")
                .ok()
                .and_then(|v| v.parse().ok()),
        })
    }
}

/// Starts the agent thread if the environment asks for it. Errors are reported on stderr
/// (QEMU's log) with the prefix `memfold-agent:`; the guest runs on unmanaged.
pub fn start_from_env() {
    let Some(cfg) = AgentConfig::from_env() else {
        return;
    };
    let _ = std::thread::Builder::new()
        .name("memfold-agent".into())
        .spawn(move || {
            if let Err(e) = run(cfg) {
                eprintln!("memfold-agent: {e}");
            }
        });
}

/// Finds the guest RAM mapping: a shared memfd mapping of `ram_bytes`. Returns its start
/// address and an fd of the memfd (matched by inode among this process's descriptors).
fn find_ram(ram_bytes: u64) -> io::Result<Option<(u64, OwnedFd)>> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    for line in maps.lines() {
        let mut parts = line.split_whitespace();
        let (Some(range), Some(perms), _, _, Some(inode)) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            continue;
        };
        let path: String = parts.collect::<Vec<_>>().join(" ");
        if !path.starts_with("/memfd:") || !perms.starts_with("rw") || !perms.ends_with('s') {
            continue;
        }
        let (s, e) = range.split_once('-').unwrap_or(("0", "0"));
        let (s, e) = (
            u64::from_str_radix(s, 16).unwrap_or(0),
            u64::from_str_radix(e, 16).unwrap_or(0),
        );
        if e - s != ram_bytes {
            continue;
        }
        let inode: u64 = inode.parse().unwrap_or(0);
        for entry in std::fs::read_dir("/proc/self/fd")?.flatten() {
            let Ok(target) = std::fs::read_link(entry.path()) else {
                continue;
            };
            if !target.to_string_lossy().starts_with("/memfd:") {
                continue;
            }
            // Read-write: CoW breaks write the private copy with pwrite.
            let Ok(file) = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(entry.path())
            else {
                continue;
            };
            let Ok(meta) = file.metadata() else { continue };
            use std::os::unix::fs::MetadataExt;
            if meta.ino() == inode && meta.len() == ram_bytes {
                return Ok(Some((s, OwnedFd::from(file))));
            }
        }
    }
    Ok(None)
}

/// A memfd holding the re-attach list of `pairs` (gfn, frame or [`RECLAIMED`]).
fn pairs_memfd(pairs: &[(u32, u32)]) -> io::Result<OwnedFd> {
    let entries: Vec<_> = pairs
        .iter()
        .map(|&(g, f)| (Gfn(g), legacy::mapped(f)))
        .collect();
    Ok(reattach::to_memfd(&entries)?)
}

/// Moves mappings with `mremap` on a helper thread: with EVENT_REMAP the mover waits
/// until the agent reads the event, so the agent's own thread cannot be the mover.
struct Remapper {
    tx: mpsc::Sender<(u64, u64, u64)>,
    done_r: OwnedFd,
}

impl Remapper {
    fn new() -> io::Result<Remapper> {
        let mut p = [0 as RawFd; 2];
        // SAFETY: pipe2 fills two fds.
        if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh fds we own.
        let (done_r, done_w) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
        let (tx, rx) = mpsc::channel::<(u64, u64, u64)>();
        std::thread::Builder::new()
            .name("memfold-remap".into())
            .spawn(move || {
                for (src, len, dst) in rx {
                    // SAFETY: moves a mapping the agent created onto guest RAM it manages.
                    let r = unsafe {
                        libc::mremap(
                            src as *mut libc::c_void,
                            len as usize,
                            len as usize,
                            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                            dst as *mut libc::c_void,
                        )
                    };
                    let errno: i32 = if r as u64 == dst {
                        0
                    } else {
                        io::Error::last_os_error().raw_os_error().unwrap_or(-1)
                    };
                    // SAFETY: writes 4 bytes from a local.
                    unsafe {
                        libc::write(
                            done_w.as_raw_fd(),
                            &errno as *const i32 as *const libc::c_void,
                            4,
                        )
                    };
                }
            })?;
        Ok(Remapper { tx, done_r })
    }
}

/// The agent's state: guest RAM, its userfaultfd and which pages are mapped onto pool frames.
pub struct Agent {
    cfg: AgentConfig,
    base: u64,
    memfd: OwnedFd,
    uffd: Uffd,
    pool: Option<OwnedFd>,
    /// The store memfd holding the blobs of stashed pages.
    store: Option<OwnedFd>,
    /// The swap file holding the blobs of swapped pages (DE §4.6), if memfoldd swaps.
    swap: Option<OwnedFd>,
    /// Per gfn: the pool frame it is mapped onto, [`PRIVATE`], [`RECLAIMED`] or [`STASHED`].
    frame_of: Vec<u32>,
    /// Where each stashed page's blob is.
    stashed: HashMap<u32, StashPage>,
    /// Stashed pages decoded back, not yet reported.
    unstashed: Vec<u32>,
    conn: Option<Conn>,
    /// CoW breaks not yet reported to memfoldd.
    breaks: Vec<(u32, u32)>,
    /// Reclaimed pages filled again, not yet reported.
    refills: Vec<u32>,
    /// Counters and latencies since start.
    wp_faults: u64,
    missing_faults: u64,
    minor_faults: u64,
    /// R and M bits per gfn since the page's clock slice was last armed.
    referenced: Vec<u64>,
    modified: Vec<u64>,
    track_lat: OpLatency,
    share_lat: OpLatency,
    cow_lat: OpLatency,
    fault_lat: OpLatency,
    reclaim_lat: OpLatency,
    stash_lat: OpLatency,
    unstash_lat: OpLatency,
    last_report: Instant,
    /// Faults read while a share was in progress, handled after it.
    deferred: Vec<Event>,
    remapper: Remapper,
    vma_budget: usize,
    last_connect: Option<Instant>,
}

/// Runs the agent until the process exits.
///
/// Errors: guest RAM never appeared, or userfaultfd is unavailable. Once attached, the
/// agent never returns while QEMU lives: losing memfoldd only makes it reconnect.
pub fn run(cfg: AgentConfig) -> io::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let (base, memfd) = loop {
        if let Some(found) = find_ram(cfg.ram_bytes)? {
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
        frame_of: vec![PRIVATE; pages],
        stashed: HashMap::new(),
        unstashed: Vec::new(),
        conn: None,
        breaks: Vec::new(),
        refills: Vec::new(),
        wp_faults: 0,
        missing_faults: 0,
        minor_faults: 0,
        // Never armed: treated as recently modified (PageClock::FRESH).
        referenced: vec![u64::MAX; pages.div_ceil(64)],
        modified: vec![u64::MAX; pages.div_ceil(64)],
        track_lat: OpLatency::default(),
        share_lat: OpLatency::default(),
        cow_lat: OpLatency::default(),
        fault_lat: OpLatency::default(),
        reclaim_lat: OpLatency::default(),
        stash_lat: OpLatency::default(),
        unstash_lat: OpLatency::default(),
        last_report: Instant::now(),
        deferred: Vec::new(),
        remapper: Remapper::new()?,
        vma_budget,
        last_connect: None,
    };
    agent.serve()
}

impl Agent {
    fn page_addr(&self, gfn: u32) -> u64 {
        self.base + gfn as u64 * PAGE
    }

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
            // SAFETY: fds is a valid array of pollfd.
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
                    eprintln!("memfold-agent: request failed: {e}; re-attaching");
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

    /// Connects and sends the hello (with the pool and the shared pages when re-attaching).
    fn attach(&mut self) {
        let Ok(conn) = Conn::connect(&self.cfg.socket) else {
            return;
        };
        // The store belongs to the memfoldd that is gone: bring its pages home first.
        if let Err(e) = self.unstash_all() {
            eprintln!("memfold-agent: restoring stashed pages: {e}; attach postponed");
            return;
        }
        let shared: Vec<(u32, u32)> = self
            .frame_of
            .iter()
            .enumerate()
            .filter(|(_, &f)| f != PRIVATE)
            .map(|(g, &f)| (g as u32, f))
            .collect();
        let hello = ToDaemon::AgentHello {
            version: PROTOCOL_VERSION,
            name: self.cfg.name.clone(),
            pid: std::process::id(),
            ram_bytes: self.cfg.ram_bytes,
            shared: shared.len() as u64,
        };
        let list;
        let mut fds = vec![self.memfd.as_fd()];
        if let Some(p) = &self.pool {
            fds.push(p.as_fd());
            let Ok(l) = pairs_memfd(&shared) else { return };
            list = l;
            fds.push(list.as_fd());
        }
        if conn.send(&hello, &fds).is_err() {
            return;
        }
        match conn.recv::<ToAgent>() {
            Ok(Some((ToAgent::Welcome { version }, mut got)))
                if version == PROTOCOL_VERSION && !got.is_empty() =>
            {
                // A restarted memfoldd that adopted our pool hands the same pool back.
                self.pool = Some(got.remove(0));
                self.store = (!got.is_empty()).then(|| got.remove(0));
                self.swap = (!got.is_empty()).then(|| got.remove(0));
                self.conn = Some(conn);
                // Breaks and refills done while detached are reflected in the list.
                self.breaks.clear();
                self.refills.clear();
            }
            Ok(other) => eprintln!(
                "memfold-agent: memfoldd refused the attach: {:?}",
                other.map(|m| m.0)
            ),
            Err(e) => eprintln!("memfold-agent: attach: {e}"),
        }
    }

    /// Sends CoW breaks and refills as they happen, counters and latencies every second.
    fn report(&mut self) {
        let Some(c) = &self.conn else { return };
        let mut msgs = Vec::new();
        if !self.breaks.is_empty() {
            msgs.push(ToDaemon::CowBroken {
                breaks: legacy::to_pairs(std::mem::take(&mut self.breaks)),
            });
        }
        if !self.refills.is_empty() {
            msgs.push(ToDaemon::Refilled {
                gfns: legacy::to_gfns(std::mem::take(&mut self.refills)),
            });
        }
        if !self.unstashed.is_empty() {
            msgs.push(ToDaemon::Unstashed {
                gfns: legacy::to_gfns(std::mem::take(&mut self.unstashed)),
            });
        }
        if self.last_report.elapsed() >= REPORT_EVERY {
            self.last_report = Instant::now();
            msgs.push(ToDaemon::AgentStats(AgentReport {
                wp_faults: self.wp_faults,
                missing_faults: self.missing_faults,
                minor_faults: self.minor_faults,
                track_ns: self.track_lat.to_pairs(),
                share_ns: self.share_lat.to_pairs(),
                cow_break_ns: self.cow_lat.to_pairs(),
                fault_ns: self.fault_lat.to_pairs(),
                reclaim_ns: self.reclaim_lat.to_pairs(),
                stash_ns: self.stash_lat.to_pairs(),
                unstash_ns: self.unstash_lat.to_pairs(),
            }));
        }
        for m in msgs {
            if c.send(&m, &[]).is_err() {
                // memfoldd gone: the re-attach lists what is still shared or reclaimed.
                self.conn = None;
                return;
            }
        }
    }

    fn command(&mut self) -> io::Result<()> {
        let msg = match self.conn.as_ref().map(|c| c.recv::<ToAgent>()) {
            Some(Ok(Some((m, _)))) => m,
            Some(Ok(None)) | Some(Err(_)) | None => {
                self.conn = None;
                return Ok(());
            }
        };
        let started = Instant::now();
        let reply = match msg {
            ToAgent::Share { batch, pages } => {
                let (shared, changed, refused) = self.share(legacy::pairs(&pages))?;
                self.share_lat.record_batch(started.elapsed(), shared.len());
                ToDaemon::ShareDone {
                    batch,
                    shared: legacy::to_gfns(shared),
                    changed: legacy::to_gfns(changed),
                    refused: legacy::to_gfns(refused),
                }
            }
            ToAgent::ReclaimZero { batch, gfns } => {
                let (reclaimed, changed, refused) = self.reclaim_zero(legacy::gfns(&gfns))?;
                self.reclaim_lat
                    .record_batch(started.elapsed(), reclaimed.len());
                ToDaemon::ReclaimDone {
                    batch,
                    reclaimed: legacy::to_gfns(reclaimed),
                    changed: legacy::to_gfns(changed),
                    refused: legacy::to_gfns(refused),
                }
            }
            ToAgent::Stash { batch, pages } => {
                let (stashed, changed, refused) = self.stash(pages)?;
                self.stash_lat
                    .record_batch(started.elapsed(), stashed.len());
                ToDaemon::StashDone {
                    batch,
                    stashed: legacy::to_gfns(stashed),
                    changed: legacy::to_gfns(changed),
                    refused: legacy::to_gfns(refused),
                }
            }
            ToAgent::ClockScan {
                batch,
                first,
                count,
            } => {
                let (count, referenced, modified) = self.clock_scan(first.0, count)?;
                ToDaemon::ClockBits {
                    batch,
                    first,
                    count,
                    referenced,
                    modified,
                }
            }
            ToAgent::Welcome { .. } => return Ok(()),
        };
        for ev in std::mem::take(&mut self.deferred) {
            self.handle_or_retry(ev);
        }
        if let Some(c) = &self.conn {
            if c.send(&reply, &[]).is_err() {
                self.conn = None;
            }
        }
        Ok(())
    }

    /// Handles a fault; a failure (the host out of memory for the private copy) is logged
    /// and retried: the faulting thread waits, it never sees a wrong byte.
    fn handle_or_retry(&mut self, ev: Event) {
        let mut delay = Duration::from_millis(1);
        while let Err(e) = self.handle(ev) {
            eprintln!("memfold-agent: fault {ev:?}: {e}; retrying");
            std::thread::sleep(delay);
            delay = (delay * 2).min(Duration::from_secs(1));
        }
    }

    fn handle(&mut self, ev: Event) -> io::Result<()> {
        let Event::Fault {
            addr,
            wp,
            write,
            minor,
        } = ev
        else {
            return Ok(()); // reading a remap event is all it needs
        };
        let started = Instant::now();
        let page = addr & !(PAGE - 1);
        if page < self.base || page >= self.base + self.cfg.ram_bytes {
            return Ok(self.uffd.wake(page, PAGE)?);
        }
        let gfn = ((page - self.base) / PAGE) as u32;
        let frame = self.frame_of[gfn as usize];
        if minor {
            if frame != PRIVATE {
                // Read before a share or reclaim changed the page: retry on the new state.
                return Ok(self.uffd.wake(page, PAGE)?);
            }
            // First access since the clock armed the page: R, and M for a write. A read
            // maps it write-protected, so that a later write still sets M.
            self.minor_faults += 1;
            self.mark(gfn, write);
            self.uffd.cont(page, PAGE, !write)?;
            self.track_lat.record(started.elapsed(), 1);
            return Ok(());
        }
        if wp {
            self.wp_faults += 1;
            return match frame {
                // Armed by the clock, or protected for a share, reclaim or stash attempt
                // that has ended: let it write (a reclaimed or stashed page then faults
                // as missing).
                PRIVATE | RECLAIMED | STASHED => {
                    self.mark(gfn, true);
                    Ok(self.uffd.write_protect(page, PAGE, false)?)
                }
                frame => {
                    self.cow_break(gfn, frame)?;
                    self.cow_lat.record(started.elapsed(), 1);
                    Ok(())
                }
            };
        }
        self.missing_faults += 1;
        match frame {
            STASHED => {
                self.unstash(gfn, write)?;
                self.unstash_lat.record(started.elapsed(), 1);
                Ok(())
            }
            PRIVATE | RECLAIMED => {
                // A hole reads as zeros: a first touch, or a reclaimed zero page. A read
                // gets it write-protected, so that a later write still sets M.
                self.mark(gfn, write);
                if write {
                    self.uffd.zeropage(page, PAGE)?;
                } else {
                    self.uffd.copy(page, &[0u8; PAGE as usize], true)?;
                }
                if frame == RECLAIMED {
                    self.frame_of[gfn as usize] = PRIVATE;
                    self.refills.push(gfn);
                }
                self.fault_lat.record(started.elapsed(), 1);
                Ok(())
            }
            _ => Ok(self.uffd.wake(page, PAGE)?), // pool frames are never holes
        }
    }

    /// Sets R (and M for a write) of `gfn`.
    fn mark(&mut self, gfn: u32, write: bool) {
        let (w, b) = (gfn as usize / 64, 1u64 << (gfn % 64));
        self.referenced[w] |= b;
        if write {
            self.modified[w] |= b;
        }
    }

    /// Reports and clears the R and M bits of `[first, first+count)` (clamped to RAM and
    /// [`CLOCK_SLICE`]) and arms the slice's private pages again. Returns (pages, R bits,
    /// M bits), bit k of word k/64 for gfn `first + k`.
    fn clock_scan(&mut self, first: u32, count: u32) -> io::Result<(u32, Vec<u64>, Vec<u64>)> {
        let npages = self.frame_of.len() as u32;
        let n = count.min(CLOCK_SLICE).min(npages.saturating_sub(first));
        let mut r = vec![0u64; (n as usize).div_ceil(64)];
        let mut m = r.clone();
        for k in 0..n {
            let g = (first + k) as usize;
            let (w, b) = (g / 64, 1u64 << (g % 64));
            let out = 1u64 << (k % 64);
            if self.referenced[w] & b != 0 {
                r[k as usize / 64] |= out;
            }
            if self.modified[w] & b != 0 {
                m[k as usize / 64] |= out;
            }
            self.referenced[w] &= !b;
            self.modified[w] &= !b;
        }
        // Arm runs of private pages; shared and reclaimed pages fault anyway.
        let mut k = 0;
        while k < n {
            if self.frame_of[(first + k) as usize] != PRIVATE {
                k += 1;
                continue;
            }
            let mut e = k + 1;
            while e < n && self.frame_of[(first + e) as usize] == PRIVATE {
                e += 1;
            }
            let (addr, len) = (self.page_addr(first + k), (e - k) as u64 * PAGE);
            self.uffd.write_protect(addr, len, true)?;
            // SAFETY: drops only the PTEs of guest RAM the agent manages; the memfd keeps
            // the pages, and the next access is a minor fault the agent serves.
            if unsafe {
                libc::madvise(addr as *mut libc::c_void, len as usize, libc::MADV_DONTNEED)
            } != 0
            {
                return Err(io::Error::other(format!(
                    "arming the clock at {addr:#x}: madvise: {}",
                    io::Error::last_os_error()
                )));
            }
            k = e;
        }
        Ok((n, r, m))
    }

    /// Copy-on-write break: the guest gets a private copy of the frame's bytes.
    fn cow_break(&mut self, gfn: u32, frame: u32) -> io::Result<()> {
        let pool = self
            .pool
            .as_ref()
            .ok_or_else(|| io::Error::other("shared page without a pool"))?;
        let mut buf = vec![0u8; PAGE as usize];
        pread_exact(pool.as_fd(), &mut buf, frame as u64 * PAGE)?;
        pwrite_all(self.memfd.as_fd(), &buf, gfn as u64 * PAGE)?;
        let addr = self.page_addr(gfn);
        // SAFETY: replaces the agent-installed pool mapping of this guest page by the guest
        // memfd page that now holds the same bytes.
        let r = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                PAGE as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                self.memfd.as_raw_fd(),
                (gfn as u64 * PAGE) as libc::off_t,
            )
        };
        if r as u64 != addr {
            return Err(io::Error::other(format!(
                "CoW break of gfn {gfn}: mmap: {}",
                io::Error::last_os_error()
            )));
        }
        // SAFETY: the page is guest RAM again (the guest memfd mapped back over it above),
        // which no Rust reference points into (see `run`).
        unsafe { self.uffd.register(addr, PAGE, RAM_MODE) }?;
        self.uffd.wake(addr, PAGE)?;
        self.frame_of[gfn as usize] = PRIVATE;
        self.breaks.push((gfn, frame));
        Ok(())
    }

    /// Frees `pages` pages of the guest memfd from `gfn` on (the caller made sure their
    /// bytes are kept elsewhere or are zero). Returns whether the kernel did.
    fn punch(&self, gfn: u32, pages: u64) -> bool {
        punch_hole(self.memfd.as_fd(), gfn as u64 * PAGE, pages * PAGE)
    }

    fn mappings(&self) -> usize {
        std::fs::read("/proc/self/maps")
            .map(|m| m.iter().filter(|&&b| b == b'\n').count())
            .unwrap_or(0)
    }

    /// Carries out a share request; returns (shared, changed, refused) gfns.
    #[allow(clippy::type_complexity)]
    fn share(&mut self, mut pages: Vec<(u32, u32)>) -> io::Result<(Vec<u32>, Vec<u32>, Vec<u32>)> {
        let (mut shared, mut changed, mut refused) = (Vec::new(), Vec::new(), Vec::new());
        let npages = self.frame_of.len() as u32;
        if self.pool.is_none() {
            refused.extend(pages.iter().map(|p| p.0));
            return Ok((shared, changed, refused));
        }
        if self.mappings() + 2 * pages.len() > self.vma_budget {
            refused.extend(pages.iter().map(|p| p.0));
            return Ok((shared, changed, refused));
        }
        pages.sort_unstable();
        pages.dedup_by_key(|p| p.0);
        pages.retain(|&(g, _)| {
            let ok = g < npages && self.frame_of[g as usize] == PRIVATE;
            if !ok {
                refused.push(g);
            }
            ok
        });
        // Runs of consecutive gfns onto consecutive frames: one mapping each.
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len()
                && pages[j].0 == pages[j - 1].0 + 1
                && pages[j].1 == pages[j - 1].1 + 1
            {
                j += 1;
            }
            self.share_run(&pages[i..j], [&mut shared, &mut changed, &mut refused])?;
            i = j;
        }
        Ok((shared, changed, refused))
    }

    fn share_run(
        &mut self,
        run: &[(u32, u32)],
        [shared, changed, refused]: [&mut Vec<u32>; 3],
    ) -> io::Result<()> {
        let (g0, f0) = run[0];
        let n = run.len();
        let len = n as u64 * PAGE;
        let addr = self.page_addr(g0);
        self.uffd.write_protect(addr, len, true)?;
        let mut guest = vec![0u8; len as usize];
        let mut frames = vec![0u8; len as usize];
        pread_exact(self.memfd.as_fd(), &mut guest, g0 as u64 * PAGE)?;
        pread_exact(self.pool()?, &mut frames, f0 as u64 * PAGE)?;
        let p = PAGE as usize;
        let equal: Vec<bool> = (0..n)
            .map(|k| guest[k * p..(k + 1) * p] == frames[k * p..(k + 1) * p])
            .collect();
        let mut k = 0;
        while k < n {
            let mut e = k + 1;
            while e < n && equal[e] == equal[k] {
                e += 1;
            }
            let (sub_addr, sub_len) = (addr + k as u64 * PAGE, (e - k) as u64 * PAGE);
            if equal[k]
                && self
                    .install(sub_addr, (f0 as u64 + k as u64) * PAGE, sub_len)
                    .is_err()
            {
                // Nothing was moved: the pages stay private.
                self.uffd.write_protect(sub_addr, sub_len, false)?;
                refused.extend((k..e).map(|m| g0 + m as u32));
            } else if equal[k] {
                // The pages are now read from the pool; failing to free the copies only
                // keeps their memory.
                self.punch(g0 + k as u32, (e - k) as u64);
                for m in k..e {
                    self.frame_of[g0 as usize + m] = f0 + m as u32;
                    shared.push(g0 + m as u32);
                }
            } else {
                self.uffd.write_protect(sub_addr, sub_len, false)?;
                changed.extend((k..e).map(|m| g0 + m as u32));
            }
            k = e;
        }
        Ok(())
    }

    /// Carries out a zero-page reclaim request; returns (reclaimed, changed, refused) gfns.
    #[allow(clippy::type_complexity)]
    fn reclaim_zero(&mut self, mut gfns: Vec<u32>) -> io::Result<(Vec<u32>, Vec<u32>, Vec<u32>)> {
        let (mut reclaimed, mut changed, mut refused) = (Vec::new(), Vec::new(), Vec::new());
        let npages = self.frame_of.len() as u32;
        gfns.sort_unstable();
        gfns.dedup();
        gfns.retain(|&g| {
            let ok = g < npages && self.frame_of[g as usize] == PRIVATE;
            if !ok {
                refused.push(g);
            }
            ok
        });
        let p = PAGE as usize;
        let mut i = 0;
        while i < gfns.len() {
            let mut j = i + 1;
            while j < gfns.len() && gfns[j] == gfns[j - 1] + 1 {
                j += 1;
            }
            let (g0, n) = (gfns[i], j - i);
            let (addr, len) = (self.page_addr(g0), n as u64 * PAGE);
            // Writers wait from here until the unprotect below.
            self.uffd.write_protect(addr, len, true)?;
            let mut bytes = vec![0u8; len as usize];
            pread_exact(self.memfd.as_fd(), &mut bytes, g0 as u64 * PAGE)?;
            for k in 0..n {
                let g = g0 + k as u32;
                if bytes[k * p..(k + 1) * p].iter().any(|&b| b != 0) {
                    changed.push(g);
                    continue;
                }
                // It was zero and writers wait: the next access refills exactly these bytes.
                if self.punch(g, 1) {
                    self.frame_of[g as usize] = RECLAIMED;
                    reclaimed.push(g);
                } else {
                    refused.push(g);
                }
            }
            self.uffd.write_protect(addr, len, false)?;
            i = j;
        }
        Ok((reclaimed, changed, refused))
    }

    /// Decodes a stashed page's blob (from the store or the swap file; for a patch with
    /// its pool reference frame) into `out`.
    ///
    /// Errors: no store, swap file or pool, a read failed, or the blob does not decode (a
    /// corrupt store: the page is then never installed).
    fn decode_stashed(&self, s: &StashPage, out: &mut Page) -> io::Result<()> {
        let store = match s.home {
            BlobHome::Store => &self.store,
            BlobHome::Swap => &self.swap,
        };
        let store = store.as_ref().ok_or_else(|| {
            io::Error::other(format!("{}: stashed page without its store", s.gfn))
        })?;
        let mut blob = vec![0u8; s.len as usize];
        pread_exact(store.as_fd(), &mut blob, s.offset)?;
        if s.home == BlobHome::Swap {
            // Read once: keep it out of the host's page cache.
            drop_cache(store.as_fd(), s.offset, s.len as u64);
        }
        let Some(encoding) = s.blob.encoding() else {
            *out = blob
                .as_slice()
                .try_into()
                .map_err(|_| io::Error::other(format!("{}: raw page of {} bytes", s.gfn, s.len)))?;
            return Ok(());
        };
        let mut reference = [0u8; PAGE as usize];
        let has_ref = if let Some(r) = s.blob.reference() {
            pread_exact(self.pool()?, &mut reference, r.offset())?;
            true
        } else {
            false
        };
        encoding
            .decode(&blob, has_ref.then_some(&reference), out)
            .map_err(|e| io::Error::other(format!("{}: stored blob: {e}", s.gfn)))
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

    /// Carries out a stash request; returns (stashed, changed, refused) gfns.
    #[allow(clippy::type_complexity)]
    fn stash(&mut self, mut pages: Vec<StashPage>) -> io::Result<(Vec<u32>, Vec<u32>, Vec<u32>)> {
        let (mut stashed, mut changed, mut refused) = (Vec::new(), Vec::new(), Vec::new());
        let npages = self.frame_of.len() as u32;
        pages.sort_unstable_by_key(|p| p.gfn);
        pages.dedup_by_key(|p| p.gfn);
        let mut decoded: Page = [0; PAGE as usize];
        let mut now: Page = [0; PAGE as usize];
        for p in pages {
            let g = p.gfn.0;
            if p.moving {
                match self.move_stashed(&p, &mut decoded, &mut now) {
                    Ok(true) => stashed.push(g),
                    Ok(false) => changed.push(g),
                    Err(e) => {
                        eprintln!("memfold-agent: move refused: {e}");
                        refused.push(g);
                    }
                }
                continue;
            }
            if g >= npages || self.frame_of[g as usize] != PRIVATE {
                refused.push(g);
                continue;
            }
            if let Err(e) = self.decode_stashed(&p, &mut decoded) {
                eprintln!("memfold-agent: stash refused: {e}");
                refused.push(g);
                continue;
            }
            let addr = self.page_addr(g);
            // Writers wait from here until the unprotect below.
            self.uffd.write_protect(addr, PAGE, true)?;
            pread_exact(self.memfd.as_fd(), &mut now, g as u64 * PAGE)?;
            if now != decoded {
                changed.push(g);
            } else {
                // Writers wait, and the blob decodes to exactly its bytes, which the next
                // access gets back.
                if self.punch(g, 1) {
                    self.frame_of[g as usize] = STASHED;
                    self.stashed.insert(g, p);
                    stashed.push(g);
                } else {
                    refused.push(g);
                }
            }
            self.uffd.write_protect(addr, PAGE, false)?;
        }
        Ok((stashed, changed, refused))
    }

    /// Moves stashed page `p.gfn` to the blob `p` names (in the swap file) if the page is
    /// still stashed in the store and both blobs decode to the same bytes. Returns whether
    /// it moved (not: the guest touched the page since, or the bytes differ). The page is
    /// not in guest RAM, and faults on it are served by this thread: nothing can change it
    /// meanwhile.
    ///
    /// Errors: a blob cannot be read or decoded.
    fn move_stashed(&mut self, p: &StashPage, new: &mut Page, old: &mut Page) -> io::Result<bool> {
        let Some(cur) = (self.stashed.get(&p.gfn.0).copied()).filter(|c| c.home == BlobHome::Store)
        else {
            return Ok(false);
        };
        self.decode_stashed(&cur, old)?;
        self.decode_stashed(p, new)?;
        if old != new {
            return Ok(false);
        }
        self.stashed.insert(
            p.gfn.0,
            StashPage {
                moving: false,
                ..*p
            },
        );
        Ok(true)
    }

    /// A missing fault on a stashed page: decode it and install it (write-protected for a
    /// read, so that a later write still sets M). On error the page stays stashed.
    fn unstash(&mut self, gfn: u32, write: bool) -> io::Result<()> {
        let s = self.stashed[&gfn];
        let mut page = [0u8; PAGE as usize];
        self.decode_stashed(&s, &mut page)?;
        self.uffd.copy(self.page_addr(gfn), &page, !write)?;
        self.stashed.remove(&gfn);
        self.frame_of[gfn as usize] = PRIVATE;
        self.mark(gfn, write);
        self.unstashed.push(gfn);
        Ok(())
    }

    /// Writes every stashed page back into the guest memfd (before re-attaching to a new
    /// memfoldd, which has a store of its own). A guest thread faulting on one meanwhile
    /// finds the page present when its fault is handled.
    fn unstash_all(&mut self) -> io::Result<()> {
        let mut page = [0u8; PAGE as usize];
        let gfns: Vec<u32> = self.stashed.keys().copied().collect();
        for g in gfns {
            let s = self.stashed[&g];
            self.decode_stashed(&s, &mut page)?;
            pwrite_all(self.memfd.as_fd(), &page, g as u64 * PAGE)?;
            self.stashed.remove(&g);
            self.frame_of[g as usize] = PRIVATE;
        }
        if self.stashed.is_empty() {
            self.store = None;
            self.swap = None;
        }
        self.unstashed.clear();
        Ok(())
    }

    /// Maps pool bytes `[pool_off, pool_off+len)` write-protected over guest address `dst`.
    /// On error nothing has changed at `dst`.
    fn install(&mut self, dst: u64, pool_off: u64, len: u64) -> io::Result<()> {
        let pool = self.pool()?.as_raw_fd();
        // SAFETY: a new mapping at an address the kernel picks.
        let staging = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                pool,
                pool_off as libc::off_t,
            )
        };
        if staging == libc::MAP_FAILED {
            return Err(io::Error::other(format!(
                "mapping pool frames: {}",
                io::Error::last_os_error()
            )));
        }
        let staging = staging as u64;
        // SAFETY: the staging mapping was just created by this function; nothing but this
        // function knows its address.
        let prepared = unsafe { self.uffd.register(staging, len, uffd::MODE_WP) }
            .and_then(|_| self.uffd.write_protect(staging, len, true))
            .map_err(io::Error::from)
            .and_then(|_| {
                self.remapper
                    .tx
                    .send((staging, len, dst))
                    .map_err(|_| io::Error::other("remap thread gone"))
            });
        if let Err(e) = prepared {
            // SAFETY: unmaps the staging mapping created above.
            unsafe { libc::munmap(staging as *mut libc::c_void, len as usize) };
            return Err(e);
        }
        // Read the remap event (the mover waits for it); keep faults for later.
        loop {
            let mut fds = [
                libc::pollfd {
                    fd: self.uffd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.remapper.done_r.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: valid pollfd array.
            unsafe { libc::poll(fds.as_mut_ptr(), 2, 1000) };
            while let Some(ev) = self.uffd.read_event()? {
                if matches!(ev, Event::Fault { .. }) {
                    self.deferred.push(ev);
                }
            }
            if fds[1].revents != 0 {
                let mut errno: i32 = 0;
                // SAFETY: reads 4 bytes into a local.
                unsafe {
                    libc::read(
                        self.remapper.done_r.as_raw_fd(),
                        &mut errno as *mut i32 as *mut libc::c_void,
                        4,
                    )
                };
                return if errno == 0 {
                    Ok(())
                } else {
                    // SAFETY: the failed move left the staging mapping in place.
                    unsafe { libc::munmap(staging as *mut libc::c_void, len as usize) };
                    Err(io::Error::other(format!(
                        "mremap onto guest RAM at {dst:#x}: {}",
                        io::Error::from_raw_os_error(errno)
                    )))
                };
            }
        }
    }
}
