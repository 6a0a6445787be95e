//! memfoldd: scans attached guests' RAM, finds identical pages and has the agents share
//! them; keeps the books.
//!
//! Content-based page sharing as in ESX §4.3: pages are read (pread of the guest memfd,
//! skipping holes with SEEK_DATA, so nothing is faulted in), hashed with xxh3 and looked up
//! in the core's [`ShareTable`]: a match with a shared frame or a hint is confirmed byte for
//! byte, then the agent is asked to map the page onto the frame; the agent re-checks the
//! bytes under write-protection, so a page written meanwhile is never shared. Scanning is
//! rate-limited in pages/s (ESX §4.3) or unlimited; hints are dropped after each full scan.
//! Zero pages ([`ZeroPolicy`]) are reclaimed by default (punched out; the agent fills a
//! zero page on the next access), or share one zero frame as in ESX, or are left alone
//! (Satori §4.1 argues for not sharing them). The single main thread owns all state; one
//! thread per connection only reads.
//!
//! With the NRU clock on and a Difference Engine policy, each classified clock slice also
//! feeds the Difference Engine (§4.2, §4.3; see [`Daemon::difference_engine`]): its cold
//! private pages are indexed by HashSimilarityDetector signatures as reference candidates,
//! patched against a similar page or compressed, the blob written to the store memfd, and
//! the agent asked to stash the page.
//!
//! With a host memory budget (DE §4.6), memfoldd measures the host memory its guests use
//! (their memfds, the pool and the store) and, while it is over the budget, pages cold
//! (C4) pages out to a swap file instead: patched, compressed or raw. The agent holds the
//! swap file too and reads a page back on its next access.

pub mod clock;
pub mod pool;
pub mod store;

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use memfold_core::blobstore::BlobKind;
use memfold_core::clock::Policy;
use memfold_core::engine::xxh3_page_hash;
use memfold_core::share::{ShareEntry, ShareTable};
use memfold_core::similarity::{SimilarityDetector, SimilarityIndex};
use memfold_core::{CompressCodec, Frame, Page, PatchCodec, SimilarityConfig, PAGE_SIZE};

use memfold_sys::memfd::{allocated_bytes, data_runs, next_data_run, pread_exact};
use memfold_wire::latency::OpLatency;
use memfold_wire::stats::{
    LifetimeCdf, OpLatencies, SavedBy, Stats, SwapStats, VmStats, AGENT_OPS,
};
use memfold_wire::{
    reattach, AgentReport, BatchId, Conn, Gfn, Listener, StashPage, ToAgent, ToClient, ToDaemon,
    MAX_BATCH, PROTOCOL_VERSION,
};

use crate::legacy::{self, NO_REFERENCE, PRIVATE, RECLAIMED, STASHED};
use clock::ClockHand;
use pool::{Pool, PoolError};
use store::{Store, StoreError};

const PAGE: u64 = PAGE_SIZE as u64;

/// Whether a p2m entry names a pool frame.
fn is_frame(f: u32) -> bool {
    f != PRIVATE && f != RECLAIMED && f != STASHED
}

/// In the similarity index, a pool frame (else a global gpn).
const FRAME_ID: u32 = 1 << 31;
/// Pages read per pread while scanning.
const READ_PAGES: usize = 64;

/// memfoldd's configuration.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// Socket path agents and clients connect to.
    pub socket: PathBuf,
    /// Scan rate limit, pages/s; 0 scans at full speed.
    pub rate: u64,
    /// What to do with zero pages.
    pub zero: ZeroPolicy,
    /// Shortest time between the starts of two full scans.
    pub min_scan_interval: Duration,
    /// Longest time between full scans: after a quiet scan (requests for under 0.1% of
    /// the pages read) the interval doubles up to this; a busy scan resets it to
    /// `min_scan_interval`.
    pub max_scan_interval: Duration,
    /// Time for the NRU clock's hand to pass over each guest once (DE §4.2; at least 4 s
    /// there); `None`: no clock, so no R/M tracking faults.
    pub clock_interval: Option<Duration>,
    /// Which mechanisms may touch pages of each NRU class (DE §4.2). Patching and
    /// compression need the clock; without it only sharing runs.
    pub policy: Policy,
    /// Patch encoding (DE §3.2).
    pub patch_codec: PatchCodec,
    /// Largest patch kept, bytes (DE §3.2: 2048).
    pub patch_cutoff: usize,
    /// Page compressor (DE §3.3).
    pub compress_codec: CompressCodec,
    /// Largest compressed page kept, bytes (DE §3.3: 2048).
    pub compress_cutoff: usize,
    /// Host memory budget for the guests' RAM (their memfds, the pool and the store),
    /// bytes; over it, cold pages are swapped out (DE §4.6). `None`: no swapping. Needs
    /// the clock.
    pub host_budget: Option<u64>,
    /// Where to create the swap file (unlinked once open).
    pub swap_file: PathBuf,
    /// Swap file capacity, bytes.
    pub swap_capacity: u64,
}

/// What memfoldd does with guest pages that are all zero.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum ZeroPolicy {
    /// Punch them out of guest RAM; the agent fills a zero page on the next access (no
    /// frame, no mapping: ESX §4.3's zero page without spending a VMA per page).
    Reclaim,
    /// Map them onto one shared zero frame, copy-on-write (ESX §4.3).
    Share,
    /// Leave them alone (Satori §4.1).
    Keep,
}

/// Daemon errors.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The socket could not be set up.
    #[error("memfoldd socket {path}: {source}")]
    Socket {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        source: io::Error,
    },
    /// The pool failed.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The store memfd or the swap file could not be created.
    #[error(transparent)]
    Store(#[from] StoreError),
}

enum Input {
    Attach {
        token: u64,
        conn: Conn,
        hello: ToDaemon,
        fds: Vec<OwnedFd>,
    },
    Agent {
        token: u64,
        msg: ToDaemon,
    },
    Gone {
        token: u64,
    },
    Client {
        conn: Conn,
        msg: ToDaemon,
    },
}

struct Vm {
    stats: VmStats,
    base_gpn: u32,
    memfd: OwnedFd,
    conn: Option<Conn>,
    /// Per gfn: pool frame mapped, PRIVATE, or RECLAIMED (a zero page punched out).
    p2m: Vec<u32>,
    /// Per gfn: named by an unanswered share or reclaim request.
    pending: Vec<bool>,
    cursor: u32,
    scanned_this_pass: bool,
    /// Share requests not yet sent: (gfn, frame).
    queue: Vec<(u32, u32)>,
    /// Zero-page reclaim requests not yet sent: gfns.
    zero_queue: Vec<u32>,
    /// The agent's latest latency histograms.
    latency: [OpLatency; AGENT_OPS],
    /// The NRU clock's hand over this guest.
    clock: ClockHand,
    /// Stashed pages: where their blob is.
    stash: HashMap<u32, Stashed>,
    /// Stash requests not yet sent.
    stash_queue: Vec<Stashed>,
    /// Blobs of moves to the swap file whose answer was lost with the agent: kept (the
    /// agent may use them) until it re-attaches or its QEMU is gone.
    orphans: Vec<Stashed>,
    /// Per gfn (bit): neither a patch nor compression was under the cut-off when last
    /// tried; not tried again until the guest writes the page.
    de_failed: Vec<u64>,
    /// Per gfn: idle clock scans the page needs before it is stored again (0: what the
    /// policy's classes say). A page the guest took back within [`RESTASH_LIVED`] waits
    /// twice as long next time (2, 4, then 7 scans: 8–28 s at a 4 s clock), so pages a
    /// workload revisits every few seconds stop cycling through decode faults; one that
    /// stayed stored longer starts afresh.
    restash_wait: Vec<u8>,
}

/// A stored page taken back sooner than this was not cold enough: see `Vm::restash_wait`.
const RESTASH_LIVED: Duration = Duration::from_secs(30);

/// A stashed page's blob (or one a stash request names).
#[derive(Clone, Copy)]
struct Stashed {
    gfn: u32,
    /// Store (or swap file) slot id.
    slot: u32,
    offset: u64,
    len: u32,
    /// Slot size, bytes.
    size: u32,
    /// Encoding; `None`: the raw page (only in the swap file).
    kind: Option<BlobKind>,
    /// Pool frame of a patch's reference page (holding a count), or [`NO_REFERENCE`].
    reference: u32,
    /// The blob is in the swap file.
    in_swap: bool,
    /// This moves a page stashed in the store to the swap file.
    moving: bool,
    since: Instant,
}

/// What keeps a stashed page out of RAM, for the books.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kept {
    Patched,
    Compressed,
    Swapped,
}

impl Stashed {
    fn page(&self) -> StashPage {
        StashPage {
            gfn: Gfn(self.gfn),
            blob: legacy::blob(self.kind, self.reference),
            home: legacy::home(self.in_swap),
            offset: self.offset,
            len: self.len,
            moving: self.moving,
        }
    }

    /// Host memory this stash frees once done, bytes: a page, or a store slot if it moves
    /// a stashed page's blob.
    fn frees(&self) -> u64 {
        if self.moving {
            self.size as u64
        } else {
            PAGE
        }
    }

    fn kept(&self) -> Kept {
        match (self.in_swap, self.kind) {
            (true, _) => Kept::Swapped,
            (false, Some(BlobKind::Patch(_))) => Kept::Patched,
            (false, _) => Kept::Compressed,
        }
    }
}

/// The counter of pages kept out of RAM by a [`Kept`].
trait KeptPages {
    fn kept_pages(&mut self, k: Kept) -> &mut u64;
}

impl KeptPages for VmStats {
    fn kept_pages(&mut self, k: Kept) -> &mut u64 {
        match k {
            Kept::Patched => &mut self.patched_pages,
            Kept::Compressed => &mut self.compressed_pages,
            Kept::Swapped => &mut self.swapped_pages,
        }
    }
}

/// An unanswered request to an agent.
enum Batch {
    Share(u64, Vec<(u32, u32)>),
    Reclaim(u64, Vec<u32>),
    Stash(u64, Vec<Stashed>),
}

/// The daemon's state, owned by its main thread.
pub struct Daemon {
    cfg: DaemonConfig,
    started: Instant,
    pool: Option<Pool>,
    adopted: bool,
    table: ShareTable,
    vms: HashMap<u64, Vm>,
    by_base: BTreeMap<u32, u64>,
    next_base: u32,
    batches: HashMap<u64, Batch>,
    next_batch: u64,
    full_scans: u64,
    pass_started: Instant,
    /// Current time between full scans (backs off while scans find little).
    scan_interval: Duration,
    /// Pages read and requests made since the current full scan started.
    pass_read: u64,
    pass_requests: u64,
    zero_frame: Option<u32>,
    zero_hash: u64,
    /// Blobs of stashed pages (created with the pool).
    store: Option<Store>,
    /// The swap file (DE §4.6), with a host budget (created with the pool).
    swap: Option<Store>,
    /// Host pages the guests' RAM used at the last budget check.
    host_used_pages: u64,
    /// Bytes still to swap out to get under the budget (the check's estimate).
    swap_wanted: u64,
    /// Swap-outs refused because the swap file was full.
    swap_full: u64,
    /// When the host memory was last measured.
    budget_checked: Instant,
    /// Reference-page candidates by similarity signature (DE §4.3): gpns, or pool frames
    /// tagged [`FRAME_ID`]. Kept across share passes, cleared once per clock cycle.
    similar: SimilarityIndex,
    /// Per pool frame used as a patch reference: patches holding it.
    patch_refs: HashMap<u32, u32>,
    /// Store slot bytes by kind: [patches, compressed pages].
    stash_bytes: [u64; 2],
    /// Swap file slot bytes.
    swap_slot_bytes: u64,
    /// Time the Difference Engine took per page: [patch encode, compress], daemon side.
    encode_lat: [OpLatency; 2],
    /// How long stashed pages stayed stashed before the guest touched them, ms.
    lifetimes: hdrhistogram::Histogram<u64>,
    /// When the similarity index was last cleared.
    similar_cleared: Instant,
}

/// Runs memfoldd until killed.
///
/// Errors: the socket cannot be bound; the pool cannot be created.
pub fn run(cfg: DaemonConfig) -> Result<(), DaemonError> {
    let listener = Listener::bind(&cfg.socket).map_err(|source| DaemonError::Socket {
        path: cfg.socket.clone(),
        source,
    })?;
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("accept".into())
        .spawn(move || accept_loop(listener, tx))
        .map_err(|source| DaemonError::Socket {
            path: cfg.socket.clone(),
            source,
        })?;
    let mut d = Daemon::new(cfg);
    d.main_loop(rx)
}

fn accept_loop(listener: Listener, tx: mpsc::Sender<Input>) {
    let mut token = 0u64;
    while let Ok(conn) = listener.accept() {
        token += 1;
        let tx = tx.clone();
        let t = token;
        let _ = std::thread::Builder::new().name(format!("conn{t}")).spawn(move || {
            let Ok(Some((hello, fds))) = conn.recv::<ToDaemon>() else { return };
            let Ok(writer) = conn.try_clone() else { return };
            match hello {
                ToDaemon::AgentHello { .. } => {
                    if tx.send(Input::Attach { token: t, conn: writer, hello, fds }).is_err() {
                        return;
                    }
                    while let Ok(Some((msg, _))) = conn.recv::<ToDaemon>() {
                        if tx.send(Input::Agent { token: t, msg }).is_err() {
                            return;
                        }
                    }
                    let _ = tx.send(Input::Gone { token: t });
                }
                ToDaemon::ClientHello { version } if version == PROTOCOL_VERSION => {
                    while let Ok(Some((msg, _))) = conn.recv::<ToDaemon>() {
                        let Ok(w) = conn.try_clone() else { return };
                        if tx.send(Input::Client { conn: w, msg }).is_err() {
                            return;
                        }
                    }
                }
                other => {
                    let message = format!("expected a hello of protocol version {PROTOCOL_VERSION}, got {other:?}");
                    let _ = writer.send(&ToClient::Error { message }, &[]);
                }
            }
        });
    }
}

/// A freed pool frame leaves the share table (and stops being the zero frame).
fn forget_frame(table: &mut ShareTable, zero_frame: &mut Option<u32>, pool: &Pool, f: u32) {
    table.remove(pool.hash(f), ShareEntry::Shared(Frame(f)));
    if *zero_frame == Some(f) {
        *zero_frame = None;
    }
}

fn process_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.split(") ").nth(1).is_some_and(|r| r.starts_with('Z')))
}

impl Daemon {
    fn new(cfg: DaemonConfig) -> Daemon {
        let zero = [0u8; PAGE_SIZE];
        Daemon {
            cfg,
            started: Instant::now(),
            pool: None,
            adopted: false,
            table: ShareTable::new(1),
            vms: HashMap::new(),
            by_base: BTreeMap::new(),
            next_base: 0,
            batches: HashMap::new(),
            next_batch: 0,
            full_scans: 0,
            pass_started: Instant::now(),
            scan_interval: Duration::ZERO,
            pass_read: 0,
            pass_requests: 0,
            zero_frame: None,
            zero_hash: xxh3_page_hash(&zero),
            store: None,
            swap: None,
            host_used_pages: 0,
            swap_wanted: 0,
            swap_full: 0,
            budget_checked: Instant::now(),
            similar: SimilarityIndex::new(
                SimilarityDetector::new(SimilarityConfig::default()).expect("default is valid"),
            ),
            patch_refs: HashMap::new(),
            stash_bytes: [0; 2],
            swap_slot_bytes: 0,
            encode_lat: Default::default(),
            lifetimes: hdrhistogram::Histogram::new_with_bounds(1, 86_400_000, 2)
                .expect("valid bounds"),
            similar_cleared: Instant::now(),
        }
    }

    fn main_loop(&mut self, rx: mpsc::Receiver<Input>) -> Result<(), DaemonError> {
        let mut last = Instant::now();
        let mut tokens = 0f64;
        let mut last_reap = Instant::now();
        loop {
            let idle = self.vms.values().all(|v| v.conn.is_none()) || self.pass_done_waiting();
            let wait = if idle {
                Duration::from_millis(50)
            } else {
                Duration::from_millis(1)
            };
            match rx.recv_timeout(wait) {
                Ok(input) => self.input(input)?,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            }
            while let Ok(input) = rx.try_recv() {
                self.input(input)?;
            }
            let now = Instant::now();
            let dt = now.duration_since(last).as_secs_f64();
            last = now;
            let budget = if self.cfg.rate == 0 {
                4096
            } else {
                tokens =
                    (tokens + dt * self.cfg.rate as f64).min(self.cfg.rate as f64 / 10.0 + 64.0);
                let b = tokens as u32;
                tokens -= b as f64;
                b
            };
            if !idle && budget > 0 {
                self.scan(budget)?;
            }
            self.flush_all();
            self.check_budget();
            self.clock_tick();
            if last_reap.elapsed() > Duration::from_secs(1) {
                last_reap = Instant::now();
                self.reap_detached();
            }
        }
    }

    /// With a host budget, measures (every 250 ms) the host memory the guests' RAM uses —
    /// their memfds, the pool and the store, as allocated pages (fstat), the same
    /// definition `memfold_vm::hostmem` measures — and sets how many pages the clock
    /// should swap out to bring it 2% under the budget (DE §4.6), net of swap-outs
    /// already under way.
    fn check_budget(&mut self) {
        let Some(budget) = self.cfg.host_budget else {
            return;
        };
        if self.budget_checked.elapsed() < Duration::from_millis(250) {
            return;
        }
        self.budget_checked = Instant::now();
        let fds = self
            .vms
            .values()
            .map(|v| v.memfd.as_fd())
            .chain(self.pool.as_ref().map(|p| p.fd().as_fd()))
            .chain(self.store.as_ref().map(|s| s.fd().as_fd()));
        self.host_used_pages = fds.map(|fd| allocated_bytes(fd) / PAGE).sum();
        let queued = self.vms.values().flat_map(|v| &v.stash_queue);
        let sent = self.batches.values().flat_map(|b| match b {
            Batch::Stash(_, recs) => &recs[..],
            _ => &[],
        });
        let in_flight: u64 = queued
            .chain(sent)
            .filter(|r| r.in_swap)
            .map(Stashed::frees)
            .sum();
        let low_water = budget / 100 * 98;
        self.swap_wanted = (self.host_used_pages * PAGE)
            .saturating_sub(low_water)
            .saturating_sub(in_flight);
    }

    fn pass_done_waiting(&mut self) -> bool {
        if self.vms.is_empty()
            || !self
                .vms
                .values()
                .filter(|v| v.conn.is_some())
                .all(|v| v.scanned_this_pass)
        {
            return false;
        }
        if self.pass_read > 0 {
            // A quiet scan doubles the interval (saving CPU at the plateau), a busy one
            // resets it (detecting new sharing quickly).
            self.scan_interval = if self.pass_requests * 1000 < self.pass_read {
                (self.scan_interval * 2).min(self.cfg.max_scan_interval)
            } else {
                self.cfg.min_scan_interval
            };
            self.pass_read = 0;
            self.pass_requests = 0;
        }
        self.scan_interval = self.scan_interval.max(self.cfg.min_scan_interval);
        if self.pass_started.elapsed() < self.scan_interval {
            return true;
        }
        // Start the next full scan: hints from the last one are stale (ESX §4.3).
        self.table.end_pass();
        self.full_scans += 1;
        self.pass_started = Instant::now();
        for v in self.vms.values_mut() {
            v.scanned_this_pass = false;
        }
        false
    }

    fn input(&mut self, input: Input) -> Result<(), DaemonError> {
        match input {
            Input::Attach {
                token,
                conn,
                hello,
                fds,
            } => self.attach(token, conn, hello, fds)?,
            Input::Agent { token, msg } => match msg {
                ToDaemon::ShareDone {
                    batch,
                    shared,
                    changed,
                    refused,
                } => self.share_done(
                    batch.0,
                    &legacy::gfns(&shared),
                    changed.len(),
                    refused.len(),
                ),
                ToDaemon::ReclaimDone {
                    batch,
                    reclaimed,
                    changed,
                    refused,
                } => self.reclaim_done(
                    batch.0,
                    &legacy::gfns(&reclaimed),
                    changed.len(),
                    refused.len(),
                ),
                ToDaemon::CowBroken { breaks } => self.cow_broken(token, &legacy::pairs(&breaks)),
                ToDaemon::Refilled { gfns } => self.refilled(token, &legacy::gfns(&gfns)),
                ToDaemon::StashDone {
                    batch,
                    stashed,
                    changed,
                    refused,
                } => self.stash_done(
                    batch.0,
                    &legacy::gfns(&stashed),
                    changed.len(),
                    refused.len(),
                ),
                ToDaemon::Unstashed { gfns } => self.unstashed(token, &legacy::gfns(&gfns)),
                ToDaemon::AgentStats(report) => self.agent_stats(token, report),
                ToDaemon::ClockBits {
                    first,
                    count,
                    referenced,
                    modified,
                    ..
                } => self.clock_bits(token, first.0, count, &referenced, &modified)?,
                _ => {}
            },
            Input::Gone { token } => self.gone(token),
            Input::Client { conn, msg } => {
                let reply = match msg {
                    ToDaemon::Stats => ToClient::Stats(Box::new(self.stats())),
                    other => ToClient::Error {
                        message: format!("unexpected request {other:?}"),
                    },
                };
                let _ = conn.send(&reply, &[]);
            }
        }
        Ok(())
    }

    fn attach(
        &mut self,
        token: u64,
        conn: Conn,
        hello: ToDaemon,
        mut fds: Vec<OwnedFd>,
    ) -> Result<(), DaemonError> {
        let ToDaemon::AgentHello {
            name,
            pid,
            ram_bytes,
            shared,
            ..
        } = hello
        else {
            return Ok(());
        };
        if fds.is_empty() {
            return Ok(());
        }
        let memfd = fds.remove(0);
        let list = if fds.len() == 2 { fds.pop() } else { None };
        let their_pool = fds.pop();
        let mut shared_list = Vec::new();
        if let Some(l) = list {
            match reattach::from_memfd(l.as_fd(), shared) {
                Ok(entries) => {
                    shared_list = entries
                        .into_iter()
                        .map(|(g, m)| (g.0, legacy::frame_entry(m)))
                        .collect()
                }
                Err(e) => {
                    eprintln!(
                        "memfoldd: {name} (pid {pid}): unreadable re-attach list ({e}); left unmanaged"
                    );
                    return Ok(());
                }
            }
        }
        match (&self.pool, their_pool) {
            (None, Some(p)) => {
                self.pool = Some(Pool::adopt(p)?);
                self.adopted = true;
            }
            (None, None) => self.pool = Some(Pool::create()?),
            (Some(mine), Some(p)) if !mine.is(&p) => {
                eprintln!("memfoldd: {name} (pid {pid}) maps another pool; left unmanaged");
                return Ok(());
            }
            _ => {}
        }
        let pages = (ram_bytes / PAGE) as u32;
        // A guest whose connection dropped while QEMU lived keeps its record.
        let old = self
            .vms
            .iter()
            .find(|(_, v)| v.stats.pid == pid && v.conn.is_none())
            .map(|(t, _)| *t);
        let mut vm = match old.and_then(|t| self.vms.remove(&t)) {
            Some(mut v) => {
                v.conn = None;
                v.stats.detached = false;
                // The agent wrote its stashed pages back before attaching again.
                self.release_stashes(&mut v);
                v
            }
            None => {
                let base = self.next_base;
                self.next_base += pages;
                self.by_base.insert(base, token);
                Vm {
                    stats: VmStats {
                        name: name.clone(),
                        pid,
                        pages: pages as u64,
                        ..Default::default()
                    },
                    base_gpn: base,
                    memfd,
                    conn: None,
                    p2m: vec![PRIVATE; pages as usize],
                    pending: vec![false; pages as usize],
                    cursor: 0,
                    scanned_this_pass: false,
                    queue: Vec::new(),
                    zero_queue: Vec::new(),
                    latency: Default::default(),
                    clock: ClockHand::new(pages as usize),
                    stash: HashMap::new(),
                    stash_queue: Vec::new(),
                    orphans: Vec::new(),
                    de_failed: vec![0; (pages as usize).div_ceil(64)],
                    restash_wait: vec![0; pages as usize],
                }
            }
        };
        self.by_base.insert(vm.base_gpn, token);
        if self.store.is_none() {
            self.store = Some(Store::create()?);
        }
        if self.swap.is_none() && self.cfg.host_budget.is_some() {
            self.swap = Some(Store::swap_file(
                &self.cfg.swap_file,
                self.cfg.swap_capacity,
            )?);
        }
        // Reconcile with what the agent says is mapped.
        let pool = self.pool.as_mut().expect("pool set above");
        let mut page = [0u8; PAGE_SIZE];
        let mut now = vec![PRIVATE; pages as usize];
        for &(g, f) in &shared_list {
            if (g as usize) < now.len() && (f < pool.size_frames() || f == RECLAIMED) {
                now[g as usize] = f;
            }
        }
        for (g, &is) in now.iter().enumerate() {
            let was = vm.p2m[g];
            if was == is {
                continue;
            }
            if is_frame(was) && pool.decref(was) {
                forget_frame(&mut self.table, &mut self.zero_frame, pool, was);
            }
            if is_frame(is) {
                if pool.refcount(is) == 0 {
                    pool.read(is, &mut page)?;
                    let h = xxh3_page_hash(&page);
                    pool.adopt_frame(is, h);
                    self.table.insert(h, ShareEntry::Shared(Frame(is)));
                    if h == self.zero_hash && page.iter().all(|&b| b == 0) {
                        self.zero_frame = Some(is);
                    }
                }
                pool.incref(is);
            }
            vm.p2m[g] = is;
        }
        vm.stats.shared_pages = vm.p2m.iter().filter(|&&f| is_frame(f)).count() as u64;
        vm.stats.zero_reclaimed_pages = vm.p2m.iter().filter(|&&f| f == RECLAIMED).count() as u64;
        let welcome = ToAgent::Welcome {
            version: PROTOCOL_VERSION,
        };
        let mut fds = vec![
            pool.fd().as_fd(),
            self.store.as_ref().expect("created above").fd().as_fd(),
        ];
        fds.extend(self.swap.as_ref().map(|s| s.fd().as_fd()));
        if conn.send(&welcome, &fds).is_ok() {
            vm.conn = Some(conn);
        }
        eprintln!(
            "memfoldd: attached {} (pid {pid}, {pages} pages, {} shared)",
            vm.stats.name, vm.stats.shared_pages
        );
        self.vms.insert(token, vm);
        Ok(())
    }

    fn gone(&mut self, token: u64) {
        let Some(vm) = self.vms.get_mut(&token) else {
            return;
        };
        vm.conn = None;
        vm.stats.detached = true;
        // Requests the agent will never answer.
        let lost: Vec<u64> = self
            .batches
            .iter()
            .filter(|(_, b)| matches!(b, Batch::Share(t, _) | Batch::Reclaim(t, _) | Batch::Stash(t, _) if *t == token))
            .map(|(b, _)| *b)
            .collect();
        for b in lost {
            if let Some(Batch::Stash(_, recs)) = self.batches.remove(&b) {
                // The agent may have stashed them: their blobs stay until it re-attaches
                // (having written them back) or its QEMU is gone.
                let vm = self.vms.get_mut(&token).expect("checked");
                for rec in recs {
                    vm.pending[rec.gfn as usize] = false;
                    if rec.moving {
                        // The agent holds the old blob or this one.
                        vm.orphans.push(rec);
                    } else {
                        vm.stash.insert(rec.gfn, rec);
                    }
                }
                continue;
            }
            self.share_done(b, &[], 0, 0);
            self.reclaim_done(b, &[], 0, 0);
        }
        self.reap_detached();
    }

    /// Releases detached guests whose QEMU has exited: their mappings are gone.
    fn reap_detached(&mut self) {
        let dead: Vec<u64> = self
            .vms
            .iter()
            .filter(|(_, v)| v.conn.is_none() && !process_alive(v.stats.pid))
            .map(|(t, _)| *t)
            .collect();
        for t in dead {
            let mut vm = self.vms.remove(&t).expect("listed");
            self.by_base.remove(&vm.base_gpn);
            self.release_stashes(&mut vm);
            if let Some(pool) = self.pool.as_mut() {
                for &f in vm.p2m.iter().filter(|&&f| is_frame(f)) {
                    if pool.decref(f) {
                        forget_frame(&mut self.table, &mut self.zero_frame, pool, f);
                    }
                }
            }
            eprintln!(
                "memfoldd: released {} (pid {})",
                vm.stats.name, vm.stats.pid
            );
        }
    }

    fn share_done(&mut self, batch: u64, shared: &[u32], changed: usize, refused: usize) {
        // Only a share batch: a reclaim batch of that number stays for reclaim_done.
        if !matches!(self.batches.get(&batch), Some(Batch::Share(..))) {
            return;
        }
        let Some(Batch::Share(token, pages)) = self.batches.remove(&batch) else {
            return;
        };
        let pool = self.pool.as_mut().expect("requests imply a pool");
        let shared: std::collections::HashSet<u32> = shared.iter().copied().collect();
        let mut vm = self.vms.get_mut(&token);
        for (g, f) in pages {
            let mapped = shared.contains(&g);
            if let Some(v) = vm.as_deref_mut() {
                v.pending[g as usize] = false;
                if mapped {
                    v.p2m[g as usize] = f;
                    v.stats.shared_pages += 1;
                    v.stats.shares += 1;
                    if self.zero_frame == Some(f) {
                        v.stats.zero_shared_pages += 1;
                    }
                }
            }
            if pool.answer(f, mapped) {
                forget_frame(&mut self.table, &mut self.zero_frame, pool, f);
            }
        }
        if let Some(v) = vm {
            v.stats.share_changed += changed as u64;
            v.stats.share_refused += refused as u64;
        }
    }

    fn reclaim_done(&mut self, batch: u64, reclaimed: &[u32], changed: usize, refused: usize) {
        if !matches!(self.batches.get(&batch), Some(Batch::Reclaim(..))) {
            return;
        }
        let Some(Batch::Reclaim(token, gfns)) = self.batches.remove(&batch) else {
            return;
        };
        let Some(vm) = self.vms.get_mut(&token) else {
            return;
        };
        for g in gfns {
            vm.pending[g as usize] = false;
        }
        for &g in reclaimed {
            if vm.p2m.get(g as usize) == Some(&PRIVATE) {
                vm.p2m[g as usize] = RECLAIMED;
                vm.stats.zero_reclaimed_pages += 1;
                vm.stats.reclaims += 1;
            }
        }
        vm.stats.share_changed += changed as u64;
        vm.stats.share_refused += refused as u64;
    }

    fn refilled(&mut self, token: u64, gfns: &[u32]) {
        let Some(vm) = self.vms.get_mut(&token) else {
            return;
        };
        for &g in gfns {
            if vm.p2m.get(g as usize) == Some(&RECLAIMED) {
                vm.p2m[g as usize] = PRIVATE;
                vm.clock.fresh(g);
                vm.stats.zero_reclaimed_pages -= 1;
                vm.stats.refills += 1;
            }
        }
    }

    fn agent_stats(&mut self, token: u64, r: AgentReport) {
        let Some(vm) = self.vms.get_mut(&token) else {
            return;
        };
        vm.stats.wp_faults = r.wp_faults;
        vm.stats.missing_faults = r.missing_faults;
        vm.stats.minor_faults = r.minor_faults;
        vm.latency = [
            &r.share_ns,
            &r.cow_break_ns,
            &r.fault_ns,
            &r.reclaim_ns,
            &r.track_ns,
            &r.stash_ns,
            &r.unstash_ns,
        ]
        .map(|p| OpLatency::from_pairs(p));
        vm.stats.latency = OpLatencies::from_histograms(&vm.latency);
    }

    /// Sends each attached guest's next clock slice when it is due.
    fn clock_tick(&mut self) {
        let Some(interval) = self.cfg.clock_interval else {
            return;
        };
        let now = Instant::now();
        for vm in self.vms.values_mut() {
            let Some(conn) = &vm.conn else { continue };
            if let Some((first, count)) = vm.clock.due_slice(now, interval) {
                self.next_batch += 1;
                let msg = ToAgent::ClockScan {
                    batch: BatchId(self.next_batch),
                    first: Gfn(first),
                    count,
                };
                // A lost connection is noticed by its reader thread.
                let _ = conn.send(&msg, &[]);
            }
        }
    }

    fn clock_bits(
        &mut self,
        token: u64,
        first: u32,
        count: u32,
        r: &[u64],
        m: &[u64],
    ) -> Result<(), DaemonError> {
        let Some(vm) = self.vms.get_mut(&token) else {
            return Ok(());
        };
        let p2m = &vm.p2m;
        let pending = &vm.pending;
        vm.clock.apply(first, count, r, m, self.full_scans, |g| {
            p2m.get(g as usize) == Some(&PRIVATE) && !pending[g as usize]
        });
        vm.stats.nru_pages = vm.clock.last_pass;
        vm.stats.clock_passes = vm.clock.passes;
        self.difference_engine(token, first, count)
    }

    /// The Difference Engine over a classified clock slice (DE §4.2, §4.3): each private
    /// page whose class lets a mechanism touch it is read once; a page a full sharing
    /// cycle has seen is patched against the most similar reference candidate (if the
    /// patch is under the cut-off) or else compressed (under the cut-off); pages allowed
    /// as references are indexed by their HashSimilarityDetector signatures. Zero pages
    /// are left to the zero policy, identical ones to the sharing scan.
    fn difference_engine(&mut self, t: u64, first: u32, count: u32) -> Result<(), DaemonError> {
        let policy = self.cfg.policy;
        let swapping = self.swap_wanted > 0;
        let acts = |a: memfold_core::clock::Actions| {
            a.reference || a.patch || a.compress || (swapping && a.swap)
        };
        if !policy.actions.iter().any(|&a| acts(a)) {
            return Ok(());
        }
        self.refresh_similarity_index();
        let Some(vm) = self.vms.get(&t) else {
            return Ok(());
        };
        if vm.conn.is_none() {
            return Ok(());
        }
        let end = (first + count).min(vm.p2m.len() as u32);
        // Never-touched RAM (holes) is neither patched nor compressed: skip it unread.
        let todo: Vec<u32> = data_runs(vm.memfd.as_fd(), Gfn(first), Gfn(end))
            .into_iter()
            .flat_map(|(Gfn(a), Gfn(b))| a..b)
            .filter(|&g| {
                vm.p2m[g as usize] == PRIVATE
                    && !vm.pending[g as usize]
                    && acts(policy.for_state(vm.clock.page(g).last_state()))
            })
            .collect();
        let mut buf = vec![0u8; READ_PAGES * PAGE_SIZE];
        let mut i = 0;
        while i < todo.len() {
            let mut j = i + 1;
            while j < todo.len() && todo[j] == todo[j - 1] + 1 && j - i < READ_PAGES {
                j += 1;
            }
            let (g0, n) = (todo[i], j - i);
            i = j;
            let fd = self.vms[&t].memfd.as_fd();
            if pread_exact(fd, &mut buf[..n * PAGE_SIZE], g0 as u64 * PAGE).is_err() {
                continue;
            }
            for k in 0..n {
                let page: &Page = buf[k * PAGE_SIZE..(k + 1) * PAGE_SIZE]
                    .try_into()
                    .expect("page");
                self.de_page(t, g0 + k as u32, page)?;
            }
        }
        self.swap_stashed(t, first, end);
        Ok(())
    }

    /// Over the budget, after the slice's resident cold pages: moves the blobs of pages
    /// the slice has stashed in the store to the swap file (DE §4.6: patched and
    /// compressed pages are swap candidates too). A patch keeps its reference frame.
    fn swap_stashed(&mut self, t: u64, first: u32, end: u32) {
        let allowed = self.cfg.policy.actions.iter().any(|a| a.swap);
        if !allowed || self.swap_wanted == 0 || self.swap.is_none() {
            return;
        }
        let vm = &self.vms[&t];
        let mut todo: Vec<Stashed> = (first..end)
            .filter(|&g| vm.p2m[g as usize] == STASHED && !vm.pending[g as usize])
            .filter_map(|g| vm.stash.get(&g).copied())
            .filter(|r| !r.in_swap)
            .collect();
        todo.sort_unstable_by_key(|r| r.since);
        let mut blob = vec![0u8; PAGE_SIZE];
        for old in todo {
            if self.swap_wanted == 0 {
                break;
            }
            let blob = &mut blob[..old.len as usize];
            let store = self.store.as_ref().expect("stashed pages imply a store");
            if pread_exact(store.fd().as_fd(), blob, old.offset).is_err() {
                continue;
            }
            let Some(slot) = self.put_blob(blob, true) else {
                break;
            };
            if old.reference != NO_REFERENCE {
                // The move's record holds the reference frame too until one is released.
                self.pool
                    .as_mut()
                    .expect("patches imply a pool")
                    .incref(old.reference);
                *self.patch_refs.entry(old.reference).or_default() += 1;
            }
            let (len, kind, r) = (old.len as usize, old.kind, old.reference);
            self.queue_stash(t, old.gfn, slot, len, kind, r, true, true);
        }
    }

    /// Clears and resizes the similarity index once every four clock intervals (DE §4.3
    /// clears it once per clock cycle: stale buckets would keep out new candidates).
    fn refresh_similarity_index(&mut self) {
        let every = self.cfg.clock_interval.unwrap_or(Duration::from_secs(4)) * 4;
        let pages: u64 = self.vms.values().map(|v| v.stats.pages).sum();
        if self.similar_cleared.elapsed() > every || self.similar.buckets() as u64 * 4 < pages {
            self.similar.clear_for(pages);
            self.similar_cleared = Instant::now();
        }
    }

    /// One page of a clock slice through the Difference Engine. Over the host budget, a
    /// page whose class allows swapping (C4) goes to the swap file in its smallest form
    /// the policy allows: patch, compressed, or raw (DE §4.6).
    fn de_page(&mut self, t: u64, g: u32, page: &Page) -> Result<(), DaemonError> {
        if page.iter().all(|&b| b == 0) || !self.sharable(t, g) {
            return Ok(());
        }
        let vm = self.vms.get_mut(&t).expect("sharable");
        let clock = vm.clock.page(g);
        // The class this slice's scan just found (`state()` would read the cleared bits).
        let a = self.cfg.policy.for_state(clock.last_state());
        let (w, bit) = (g as usize / 64, 1u64 << (g % 64));
        if clock.idle_scans() == 0 {
            vm.de_failed[w] &= !bit; // written since: worth another try
        }
        // Sharing goes first: nothing is stored before a full sharing cycle saw the page,
        // nor before it has been idle as long as its history asks.
        let seen = vm.clock.seen_by_sharing(g, self.full_scans)
            && clock.idle_scans() >= vm.restash_wait[g as usize];
        let untried = vm.de_failed[w] & bit == 0;
        let to_swap = seen && a.swap && self.swap_wanted > 0;
        let gpn = vm.base_gpn + g;
        let sigs = self.similar.detector().signatures(page);
        if a.patch && seen && untried && self.try_patch(t, g, gpn, &sigs, page, to_swap)? {
            return Ok(());
        }
        if a.compress && seen && untried {
            if self.try_compress(t, g, page, to_swap) {
                return Ok(());
            }
            // Incompressible and unpatchable as it is: spare the CPU until it changes.
            self.vms.get_mut(&t).expect("sharable").de_failed[w] |= bit;
        }
        if to_swap {
            if let Some(slot) = self.put_blob(page, true) {
                self.queue_stash(t, g, slot, PAGE_SIZE, None, NO_REFERENCE, true, false);
                return Ok(());
            }
        }
        if a.reference {
            self.similar.insert(&sigs, gpn);
        }
        Ok(())
    }

    /// Reads reference candidate `id` (a pool frame or a sharable guest page) into `out`.
    fn candidate(&self, id: u32, out: &mut Page) -> bool {
        if id & FRAME_ID != 0 {
            let f = id & !FRAME_ID;
            let pool = self.pool.as_ref().expect("attached guests imply a pool");
            // Only a frame something holds is immutable.
            return f < pool.size_frames() && pool.refcount(f) > 0 && pool.read(f, out).is_ok();
        }
        let Some((t2, g2)) = self.locate(id).filter(|&(t2, g2)| self.sharable(t2, g2)) else {
            return false;
        };
        pread_exact(self.vms[&t2].memfd.as_fd(), out, g2 as u64 * PAGE).is_ok()
    }

    /// Patches page `g` of guest `t` against its most similar reference candidate (DE
    /// §3.2, §4.3): every candidate whose signatures still match gets a patch, the
    /// smallest under the cut-off is kept. A guest page chosen as reference is copied into
    /// a pool frame (which no guest can write, so the patch stays valid whatever the
    /// guest does) and shared onto it. The patch goes to the swap file if `to_swap`.
    /// Returns whether a stash was queued.
    ///
    /// Errors: the pool failed (host out of memory).
    fn try_patch(
        &mut self,
        t: u64,
        g: u32,
        gpn: u32,
        sigs: &[u32; 8],
        page: &Page,
        to_swap: bool,
    ) -> Result<bool, DaemonError> {
        let mut cands = Vec::new();
        self.similar.candidates(sigs, &mut cands);
        let codec = self.cfg.patch_codec;
        let mut other = [0u8; PAGE_SIZE];
        let mut blob = Vec::new();
        let mut best: Option<(u32, Vec<u8>, Box<Page>)> = None;
        for c in cands {
            if c == gpn || !self.candidate(c, &mut other) {
                continue;
            }
            if !self.similar.matches(sigs, &other) || other == *page {
                continue; // a bucket neighbour or changed; identical is the share scan's
            }
            let started = Instant::now();
            if codec.encode(&other, page, &mut blob).is_err() {
                continue;
            }
            self.encode_lat[0].record(started.elapsed(), 1);
            if !blob.is_empty()
                && blob.len() <= self.cfg.patch_cutoff
                && best.as_ref().is_none_or(|b| blob.len() < b.1.len())
            {
                best = Some((c, blob.clone(), Box::new(other)));
            }
        }
        let Some((c, blob, reference)) = best else {
            return Ok(false);
        };
        let Some(slot) = self.put_blob(&blob, to_swap) else {
            return Ok(false);
        };
        let f = if c & FRAME_ID != 0 {
            c & !FRAME_ID
        } else {
            let (t2, g2) = self.locate(c).expect("candidate() located it");
            let h = xxh3_page_hash(&reference);
            let pool = self.pool.as_mut().expect("attached guests imply a pool");
            let f = match pool.alloc(&reference[..], h) {
                Ok(f) => f,
                Err(e) => {
                    self.store_for(to_swap).expect("put above").free(slot.id);
                    return Err(e.into());
                }
            };
            self.table.insert(h, ShareEntry::Shared(Frame(f)));
            let ref_sigs = self.similar.detector().signatures(&reference);
            self.similar.insert(&ref_sigs, FRAME_ID | f);
            self.enqueue(t2, g2, f);
            f
        };
        let pool = self.pool.as_mut().expect("attached guests imply a pool");
        pool.incref(f);
        *self.patch_refs.entry(f).or_default() += 1;
        let kind = Some(BlobKind::Patch(codec));
        self.queue_stash(t, g, slot, blob.len(), kind, f, to_swap, false);
        Ok(true)
    }

    /// Compresses page `g` of guest `t` (DE §3.3) and queues its stash (to the swap file
    /// if `to_swap`) if the result is under the cut-off. Returns whether it did.
    fn try_compress(&mut self, t: u64, g: u32, page: &Page, to_swap: bool) -> bool {
        let codec = self.cfg.compress_codec;
        let mut blob = Vec::new();
        let started = Instant::now();
        if codec.compress(page, &mut blob).is_err() {
            return false;
        }
        self.encode_lat[1].record(started.elapsed(), 1);
        if blob.is_empty() || blob.len() > self.cfg.compress_cutoff {
            return false;
        }
        let Some(slot) = self.put_blob(&blob, to_swap) else {
            return false;
        };
        let kind = Some(BlobKind::Compressed(codec));
        self.queue_stash(t, g, slot, blob.len(), kind, NO_REFERENCE, to_swap, false);
        true
    }

    /// The store memfd, or the swap file if `swap`.
    fn store_for(&mut self, swap: bool) -> Option<&mut Store> {
        if swap {
            self.swap.as_mut()
        } else {
            self.store.as_mut()
        }
    }

    /// Writes a blob into the store memfd or the swap file; `None` if it cannot take it
    /// (logged; a full swap file stops swapping until the next budget check).
    fn put_blob(&mut self, blob: &[u8], swap: bool) -> Option<memfold_core::slab::Slot> {
        match self.store_for(swap)?.put(blob) {
            Ok(s) => Some(s),
            Err(e @ StoreError::Full { .. }) => {
                self.swap_full += 1;
                self.swap_wanted = 0;
                if self.swap_full.is_power_of_two() {
                    eprintln!("memfoldd: {e} (refusal {})", self.swap_full);
                }
                None
            }
            Err(e) => {
                eprintln!("memfoldd: {e}; page left in guest RAM");
                None
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn queue_stash(
        &mut self,
        t: u64,
        g: u32,
        slot: memfold_core::slab::Slot,
        len: usize,
        kind: Option<BlobKind>,
        reference: u32,
        in_swap: bool,
        moving: bool,
    ) {
        *self.slot_bytes(in_swap, kind) += slot.size as u64;
        self.pass_requests += 1;
        let vm = self.vms.get_mut(&t).expect("sharable");
        vm.pending[g as usize] = true;
        let rec = Stashed {
            gfn: g,
            slot: slot.id,
            offset: slot.offset,
            len: len as u32,
            size: slot.size,
            kind,
            reference,
            in_swap,
            moving,
            since: Instant::now(),
        };
        if in_swap {
            self.swap_wanted = self.swap_wanted.saturating_sub(rec.frees());
        }
        vm.stash_queue.push(rec);
        if vm.stash_queue.len() >= MAX_BATCH {
            self.flush(t);
        }
    }

    /// The slot bytes a blob of `kind` counts under: the swap file's, or the store's
    /// patches or compressed pages.
    fn slot_bytes(&mut self, in_swap: bool, kind: Option<BlobKind>) -> &mut u64 {
        if in_swap {
            &mut self.swap_slot_bytes
        } else {
            &mut self.stash_bytes[matches!(kind, Some(BlobKind::Compressed(_))) as usize]
        }
    }

    /// Frees a stash record's blob and its hold on the reference frame.
    fn release_stash(&mut self, rec: Stashed) {
        if let Some(store) = self.store_for(rec.in_swap) {
            store.free(rec.slot);
        }
        *self.slot_bytes(rec.in_swap, rec.kind) -= rec.size as u64;
        if rec.reference == NO_REFERENCE {
            return;
        }
        let f = rec.reference;
        if let Some(n) = self.patch_refs.get_mut(&f) {
            *n -= 1;
            if *n == 0 {
                self.patch_refs.remove(&f);
            }
        }
        let pool = self.pool.as_mut().expect("patches imply a pool");
        if pool.decref(f) {
            forget_frame(&mut self.table, &mut self.zero_frame, pool, f);
        }
    }

    /// Releases every blob guest `vm` holds (its stashed pages and lost moves), for a
    /// guest gone or re-attaching (its agent wrote its stashed pages back first): the
    /// pages are private again and its stash counters zero.
    fn release_stashes(&mut self, vm: &mut Vm) {
        for (_, rec) in std::mem::take(&mut vm.stash) {
            if vm.p2m[rec.gfn as usize] == STASHED {
                vm.p2m[rec.gfn as usize] = PRIVATE;
            }
            self.release_stash(rec);
        }
        for rec in std::mem::take(&mut vm.orphans) {
            self.release_stash(rec);
        }
        vm.stats.patched_pages = 0;
        vm.stats.compressed_pages = 0;
        vm.stats.swapped_pages = 0;
    }

    fn stash_done(&mut self, batch: u64, stashed: &[u32], changed: usize, refused: usize) {
        if !matches!(self.batches.get(&batch), Some(Batch::Stash(..))) {
            return;
        }
        let Some(Batch::Stash(token, recs)) = self.batches.remove(&batch) else {
            return;
        };
        let stashed: std::collections::HashSet<u32> = stashed.iter().copied().collect();
        let mut release = Vec::new();
        match self.vms.get_mut(&token) {
            Some(vm) => {
                for rec in recs {
                    let g = rec.gfn as usize;
                    vm.pending[g] = false;
                    if rec.moving {
                        // Moved only if the agent still had it stashed in the store.
                        let moved = stashed.contains(&rec.gfn) && vm.p2m[g] == STASHED;
                        match vm.stash.get_mut(&rec.gfn).filter(|_| moved) {
                            Some(old) => {
                                let moved = Stashed {
                                    moving: false,
                                    since: old.since,
                                    ..rec
                                };
                                let old = std::mem::replace(old, moved);
                                *vm.stats.kept_pages(old.kept()) -= 1;
                                *vm.stats.kept_pages(Kept::Swapped) += 1;
                                vm.stats.swap_outs += 1;
                                vm.stats.swap_moves += 1;
                                release.push(old);
                            }
                            None => release.push(rec),
                        }
                        continue;
                    }
                    if stashed.contains(&rec.gfn) && vm.p2m[g] == PRIVATE {
                        vm.p2m[g] = STASHED;
                        vm.stash.insert(rec.gfn, rec);
                        *vm.stats.kept_pages(rec.kept()) += 1;
                        *match rec.kept() {
                            Kept::Patched => &mut vm.stats.patches,
                            Kept::Compressed => &mut vm.stats.compressions,
                            Kept::Swapped => &mut vm.stats.swap_outs,
                        } += 1;
                    } else {
                        release.push(rec);
                    }
                }
                vm.stats.stash_changed += changed as u64;
                vm.stats.stash_refused += refused as u64;
            }
            None => release = recs,
        }
        for rec in release {
            self.release_stash(rec);
        }
    }

    fn unstashed(&mut self, token: u64, gfns: &[u32]) {
        let Some(vm) = self.vms.get_mut(&token) else {
            return;
        };
        let mut release = Vec::new();
        for &g in gfns {
            if vm.p2m.get(g as usize) != Some(&STASHED) {
                continue;
            }
            let Some(rec) = vm.stash.remove(&g) else {
                continue;
            };
            vm.p2m[g as usize] = PRIVATE;
            vm.clock.fresh(g);
            vm.stats.unstashes += 1;
            let wait = &mut vm.restash_wait[g as usize];
            *wait = if rec.since.elapsed() >= RESTASH_LIVED {
                0
            } else {
                (*wait * 2).clamp(2, 7)
            };
            *vm.stats.kept_pages(rec.kept()) -= 1;
            if rec.kept() == Kept::Swapped {
                vm.stats.swap_ins += 1;
            }
            let ms = rec.since.elapsed().as_millis().max(1) as u64;
            let _ = self.lifetimes.record(ms.min(86_400_000));
            release.push(rec);
        }
        for rec in release {
            self.release_stash(rec);
        }
    }

    fn cow_broken(&mut self, token: u64, breaks: &[(u32, u32)]) {
        let Some(vm) = self.vms.get_mut(&token) else {
            return;
        };
        let pool = self.pool.as_mut().expect("shared pages imply a pool");
        for &(g, f) in breaks {
            if vm.p2m.get(g as usize) != Some(&f) {
                continue;
            }
            vm.p2m[g as usize] = PRIVATE;
            vm.clock.fresh(g);
            vm.stats.shared_pages -= 1;
            vm.stats.cow_breaks += 1;
            if self.zero_frame == Some(f) {
                vm.stats.zero_shared_pages = vm.stats.zero_shared_pages.saturating_sub(1);
            }
            if pool.decref(f) {
                forget_frame(&mut self.table, &mut self.zero_frame, pool, f);
            }
        }
    }

    /// Scans up to `budget` pages, round-robin over guests (ESX §4.3's rate-limited scan).
    fn scan(&mut self, mut budget: u32) -> Result<(), DaemonError> {
        let tokens: Vec<u64> = self
            .vms
            .iter()
            .filter(|(_, v)| v.conn.is_some() && !v.scanned_this_pass)
            .map(|(t, _)| *t)
            .collect();
        if tokens.is_empty() {
            return Ok(());
        }
        let share = (budget / tokens.len() as u32).max(READ_PAGES as u32);
        let mut buf = vec![0u8; READ_PAGES * PAGE_SIZE];
        for t in tokens {
            let mut mine = share.min(budget);
            while mine > 0 {
                let Some((gfn, n)) = self.next_chunk(t, mine as usize, &mut buf) else {
                    break;
                };
                mine = mine.saturating_sub(n as u32);
                budget = budget.saturating_sub(n as u32);
                for k in 0..n {
                    let page: &Page = buf[k * PAGE_SIZE..(k + 1) * PAGE_SIZE]
                        .try_into()
                        .expect("page");
                    self.consider(t, gfn + k as u32, page)?;
                }
            }
        }
        Ok(())
    }

    /// Reads the next run of resident pages of guest `t` from its cursor; None at the end
    /// of its RAM (the guest's pass is then done).
    fn next_chunk(&mut self, t: u64, max: usize, buf: &mut [u8]) -> Option<(u32, usize)> {
        let vm = self.vms.get_mut(&t)?;
        let fd = vm.memfd.as_fd();
        let Some((Gfn(gfn), Gfn(run_end))) =
            next_data_run(fd, Gfn(vm.cursor), Gfn(vm.p2m.len() as u32))
        else {
            vm.cursor = 0;
            vm.scanned_this_pass = true;
            return None;
        };
        let n = ((run_end - gfn) as usize).min(max).clamp(1, READ_PAGES);
        if pread_exact(fd, &mut buf[..n * PAGE_SIZE], gfn as u64 * PAGE).is_err() {
            vm.cursor = 0;
            vm.scanned_this_pass = true;
            return None;
        }
        vm.cursor = gfn + n as u32;
        vm.stats.scanned_pages += n as u64;
        self.pass_read += n as u64;
        if vm.cursor as usize >= vm.p2m.len() {
            vm.cursor = 0;
            vm.scanned_this_pass = true;
        }
        Some((gfn, n))
    }

    fn locate(&self, gpn: u32) -> Option<(u64, u32)> {
        let (&base, &t) = self.by_base.range(..=gpn).next_back()?;
        let vm = self.vms.get(&t)?;
        let g = gpn - base;
        (vm.base_gpn == base && (g as usize) < vm.p2m.len()).then_some((t, g))
    }

    fn sharable(&self, t: u64, g: u32) -> bool {
        self.vms.get(&t).is_some_and(|v| {
            v.conn.is_some() && v.p2m[g as usize] == PRIVATE && !v.pending[g as usize]
        })
    }

    /// Whether the policy lets the sharing scan touch page `g` of guest `t` in the class
    /// the clock's last scan found (DE §4.2: C1 pages are ignored, so pages the guest is
    /// writing are not shared only to be CoW-broken, nor zero pages reclaimed only to be
    /// refilled). Without the clock, every page.
    fn class_allows_share(&self, t: u64, g: u32) -> bool {
        self.cfg.clock_interval.is_none()
            || self.vms.get(&t).is_some_and(|v| {
                self.cfg
                    .policy
                    .for_state(v.clock.page(g).last_state())
                    .share
            })
    }

    /// One scanned page: share it with a frame or a hint, or leave a hint.
    fn consider(&mut self, t: u64, g: u32, page: &Page) -> Result<(), DaemonError> {
        if !self.sharable(t, g) {
            return Ok(());
        }
        if !self.class_allows_share(t, g) {
            self.vms.get_mut(&t).expect("sharable").stats.hot_skipped += 1;
            return Ok(());
        }
        let h = xxh3_page_hash(page);
        let zero = h == self.zero_hash && page.iter().all(|&b| b == 0);
        match self.cfg.zero {
            ZeroPolicy::Keep if zero => return Ok(()),
            ZeroPolicy::Reclaim if zero => {
                let vm = self.vms.get_mut(&t).expect("sharable");
                vm.pending[g as usize] = true;
                vm.zero_queue.push(g);
                self.pass_requests += 1;
                if vm.zero_queue.len() >= MAX_BATCH {
                    self.flush(t);
                }
                return Ok(());
            }
            _ => {}
        }
        let gpn = self.vms[&t].base_gpn + g;
        let mut other = [0u8; PAGE_SIZE];
        let candidates: Vec<ShareEntry> = self.table.lookup(h).collect();
        for e in candidates {
            match e {
                ShareEntry::Shared(Frame(f)) => {
                    let pool = self.pool.as_mut().expect("attached guests imply a pool");
                    pool.read(f, &mut other)?;
                    if other == *page {
                        pool.add_pending(f);
                        self.enqueue(t, g, f);
                        return Ok(());
                    }
                }
                ShareEntry::Hint(hint) => {
                    if hint == gpn {
                        return Ok(());
                    }
                    let Some((t2, g2)) = self.locate(hint).filter(|&(t2, g2)| {
                        self.sharable(t2, g2) && self.class_allows_share(t2, g2)
                    }) else {
                        self.table.remove(h, e);
                        continue;
                    };
                    let fd = self.vms[&t2].memfd.as_fd();
                    if pread_exact(fd, &mut other, g2 as u64 * PAGE).is_err() || other != *page {
                        self.table.remove(h, e); // the hinted page changed
                        continue;
                    }
                    let pool = self.pool.as_mut().expect("attached guests imply a pool");
                    let f = pool.alloc(page, h)?;
                    pool.add_pending(f);
                    self.table.replace(h, e, ShareEntry::Shared(Frame(f)));
                    if zero {
                        self.zero_frame = Some(f);
                    }
                    self.enqueue(t2, g2, f);
                    self.enqueue(t, g, f);
                    return Ok(());
                }
            }
        }
        self.table.insert(h, ShareEntry::Hint(gpn));
        Ok(())
    }

    fn enqueue(&mut self, t: u64, g: u32, f: u32) {
        self.pass_requests += 1;
        let vm = self.vms.get_mut(&t).expect("sharable");
        vm.pending[g as usize] = true;
        vm.queue.push((g, f));
        if vm.queue.len() >= MAX_BATCH {
            self.flush(t);
        }
    }

    fn flush_all(&mut self) {
        let ts: Vec<u64> = self
            .vms
            .iter()
            .filter(|(_, v)| {
                !v.queue.is_empty() || !v.zero_queue.is_empty() || !v.stash_queue.is_empty()
            })
            .map(|(t, _)| *t)
            .collect();
        for t in ts {
            self.flush(t);
        }
    }

    /// Sends guest `t`'s queued share and reclaim requests.
    fn flush(&mut self, t: u64) {
        let vm = self.vms.get_mut(&t).expect("listed");
        let pages = std::mem::take(&mut vm.queue);
        let gfns = std::mem::take(&mut vm.zero_queue);
        let stash = std::mem::take(&mut vm.stash_queue);
        let mut requests = Vec::new();
        if stash.iter().any(|r| r.in_swap) {
            // Swapped pages must leave host memory: not linger in the page cache.
            if let Some(Err(e)) = self.swap.as_ref().map(Store::write_back) {
                eprintln!("memfoldd: swap file write-back: {e}");
            }
        }
        if !stash.is_empty() {
            self.next_batch += 1;
            let batch = self.next_batch;
            let msg = ToAgent::Stash {
                batch: BatchId(batch),
                pages: stash.iter().map(Stashed::page).collect(),
            };
            requests.push((batch, msg, Batch::Stash(t, stash)));
        }
        if !pages.is_empty() {
            self.next_batch += 1;
            let batch = self.next_batch;
            let msg = ToAgent::Share {
                batch: BatchId(batch),
                pages: legacy::to_pairs(pages.clone()),
            };
            requests.push((batch, msg, Batch::Share(t, pages)));
        }
        if !gfns.is_empty() {
            self.next_batch += 1;
            let batch = self.next_batch;
            let msg = ToAgent::ReclaimZero {
                batch: BatchId(batch),
                gfns: legacy::to_gfns(gfns.clone()),
            };
            requests.push((batch, msg, Batch::Reclaim(t, gfns)));
        }
        for (batch, msg, pending) in requests {
            let sent = self.vms[&t]
                .conn
                .as_ref()
                .is_some_and(|c| c.send(&msg, &[]).is_ok());
            self.batches.insert(batch, pending);
            if !sent {
                // Never answered: release the pages.
                self.share_done(batch, &[], 0, 0);
                self.reclaim_done(batch, &[], 0, 0);
                self.stash_done(batch, &[], 0, 0);
            }
        }
    }

    fn lifetime_cdf(&self) -> LifetimeCdf {
        let h = &self.lifetimes;
        let restored = h.len();
        let restored_before = [1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0]
            .iter()
            .map(|&s: &f64| {
                let below = h.count_between(0, (s * 1000.0) as u64 - 1);
                (
                    s,
                    if restored == 0 {
                        0.0
                    } else {
                        below as f64 / restored as f64
                    },
                )
            })
            .collect();
        let now: Vec<&Stashed> = self.vms.values().flat_map(|v| v.stash.values()).collect();
        let old_now = now
            .iter()
            .filter(|r| r.since.elapsed() >= Duration::from_secs(10))
            .count() as u64;
        let long_restored = restored - h.count_between(0, 9_999);
        let total = restored + now.len() as u64;
        LifetimeCdf {
            restored,
            stashed_now: now.len() as u64,
            restored_before,
            lived_10s: if total == 0 {
                0.0
            } else {
                (long_restored + old_now) as f64 / total as f64
            },
        }
    }

    /// Current statistics.
    pub fn stats(&self) -> Stats {
        let mut vms: Vec<VmStats> = self.vms.values().map(|v| v.stats.clone()).collect();
        vms.sort_by(|a, b| a.name.cmp(&b.name));
        let mapped: u64 = vms.iter().map(|v| v.shared_pages).sum();
        let reclaimed: u64 = vms.iter().map(|v| v.zero_reclaimed_pages).sum();
        let patched: u64 = vms.iter().map(|v| v.patched_pages).sum();
        let compressed: u64 = vms.iter().map(|v| v.compressed_pages).sum();
        let swapped: u64 = vms.iter().map(|v| v.swapped_pages).sum();
        let frames = self.pool.as_ref().map_or(0, |p| p.in_use()) as u64;
        let mut all: [OpLatency; AGENT_OPS] = Default::default();
        for v in self.vms.values() {
            for (a, h) in all.iter_mut().zip(&v.latency) {
                a.merge(h);
            }
        }
        let mut latency = OpLatencies::from_histograms(&all);
        latency.patch_encode = self.encode_lat[0].summary();
        latency.compress = self.encode_lat[1].summary();
        // Frames only patches hold: no guest page maps them.
        let reference_frames = self.pool.as_ref().map_or(0, |pool| {
            self.patch_refs
                .iter()
                .filter(|&(&f, &n)| pool.refcount(f) == n)
                .count() as u64
        });
        let store_pages = self.store.as_ref().map_or(0, |s| s.stats().chunks);
        let page = PAGE as i64;
        let saved_by = SavedBy {
            sharing: mapped as i64 - (frames - reference_frames) as i64,
            zero: reclaimed as i64,
            patching: patched as i64 - self.stash_bytes[0] as i64 / page - reference_frames as i64,
            compression: compressed as i64 - self.stash_bytes[1] as i64 / page,
            swap: swapped as i64,
            store_waste: store_pages as i64
                - (self.stash_bytes[0] + self.stash_bytes[1]) as i64 / page,
        };
        Stats {
            uptime_s: self.started.elapsed().as_secs_f64(),
            rate_pages_per_s: self.cfg.rate,
            full_scans: self.full_scans,
            frames,
            mapped_pages: mapped,
            zero_reclaimed_pages: reclaimed,
            saved_pages: mapped as i64 - frames as i64
                + reclaimed as i64
                + patched as i64
                + compressed as i64
                + swapped as i64
                - store_pages as i64,
            saved_by,
            patched_pages: patched,
            compressed_pages: compressed,
            store_pages,
            reference_frames,
            swap: SwapStats {
                budget_pages: self.cfg.host_budget.map(|b| b / PAGE),
                host_used_pages: self.host_used_pages,
                swapped_pages: swapped,
                slot_bytes: self.swap_slot_bytes,
                file_pages: self.swap.as_ref().map_or(0, |s| s.stats().chunks),
                capacity_pages: self
                    .swap
                    .as_ref()
                    .and_then(Store::capacity)
                    .map_or(0, |c| c / PAGE),
                full: self.swap_full,
                wanted_pages: self.swap_wanted / PAGE,
            },
            lifetime: self.lifetime_cdf(),
            policy: self.cfg.policy.name.to_string(),
            latency,
            table_entries: self.table.len() as u64,
            adopted_pool: self.adopted,
            vms,
        }
    }
}
