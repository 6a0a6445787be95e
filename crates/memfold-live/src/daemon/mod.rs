//! memfoldd: runs the one engine (`memfold_core::Engine`) over live guests.
//!
//! The engine decides — the sharing scan (ESX §4.3), the NRU clock and the Difference
//! Engine over its slices (DE §4.2–4.6), the host budget — reading guest RAM through its
//! memfd and keeping frames in each sharing domain's pool memfd and blobs in each guest's
//! own store memfd and swap file ([`backings`]). This daemon carries its plan out:
//!
//! | file | concern |
//! |---|---|
//! | `mod.rs` | the main loop: inputs, scan, clock, budget, flush, reap; attach |
//! | `readers` | connections: the accept thread, a reader each, the hello |
//! | `guests` | each guest's connection, its agent's reports, liveness |
//! | `executor` | commands → batches to agents; answers → outcomes to the engine |
//! | [`backings`] | the engine's backings on memfds and files |
//! | `books` | the books' export as the wire's statistics |
//! | `domains.rs` | sharing domains: who shares with whom, the pool a re-attaching agent brings |
//! | [`balloon`] | entitlements claimed and repaid through each guest's balloon (Satori §4.2–4.3) |
//!
//! The main thread owns all state; the reader threads only read and forward.

mod adoption;
mod agent_messages;
mod attach;
pub mod backings;
pub mod balloon;
mod books;
mod devices;
mod domains;
mod executor;
mod guests;
mod opt_outs;
mod outbox;
mod readers;

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use memfold_core::backing::{BackingError, Clock};
use memfold_core::ids::DomainId;
use memfold_core::{ClaimPolicy, Engine, EngineConfig, EngineError, PAGE_SIZE};
use memfold_sys::memfd;
use memfold_wire::{Listener, ToAgent, ToClient, ToDaemon};

use backings::FileBacking;
use domains::DomainKey;
pub use domains::DomainRule;
use executor::Executor;
use guests::Guests;
use readers::Input;
pub use readers::{
    tenant_connection_cap, HELLO_TIMEOUT, MAX_HELLOS_WAITING, MIN_TENANT_CONNECTIONS,
};

use crate::guest_channel::GuestChannels;
use crate::monitor::QemuLayouts;

const PAGE: u64 = PAGE_SIZE as u64;

/// The largest guest memfoldd takes, pages (256 GiB): the engine's books for a guest
/// are sized by what its agent says, so an agent must not be able to make memfoldd
/// allocate without bound.
const MAX_GUEST_PAGES: u64 = 1 << 26;

/// How long a stopping memfoldd waits for the answers to batches it has sent before it
/// leaves them to the agents' re-attach (the crash-safety path), s.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// memfoldd's configuration.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// Socket path agents and clients connect to.
    pub socket: PathBuf,
    /// The engine's parameters.
    pub engine: EngineConfig,
    /// Folder for the guests' swap files (one each, `O_TMPFILE`), with a host budget.
    pub swap_dir: PathBuf,
    /// The capacity of all swap files together, bytes.
    pub swap_capacity: u64,
    /// Which guests share with one another.
    pub domains: DomainRule,
    /// The guests (by the name their agent attaches with, QEMU's `-name`) the operator
    /// marked never-share (Satori §4.3, against the write-latency side channel): each is
    /// a sharing domain of its own whatever [`DaemonConfig::domains`] says, so its pages
    /// are shared only with its own (ESX's salting), never with, patched against or used
    /// as reference for another VM's. Kept by name, so it holds across a guest's
    /// re-attach and memfoldd's restart (the list is memfoldd's configuration).
    pub never_share: BTreeSet<String>,
    /// A group whose members' QEMUs may attach (the socket becomes mode 0660, that
    /// group's): QEMUs that run as users of their own (one per tenant, a domain each
    /// under [`DomainRule::User`]). They are not operators. `None`: root and memfoldd's
    /// own user only (mode 0600).
    pub agent_gid: Option<u32>,
    /// How guests claim their sharing entitlements through their balloons (Satori §4.2).
    pub claim: ClaimPolicy,
    /// Each guest's base allowance, bytes: what its balloon leaves it before entitlement
    /// (with a claim policy other than `Never`).
    pub allowance: u64,
    /// Guest RAM, bytes, that one tenant's guests (the QEMUs of one uid other than root
    /// and memfoldd's own) may have attached together; a hello past it is refused.
    /// memfoldd books each guest page (its P2M, hints, clock: about 0.5% of guest RAM,
    /// docs/metadata.md), and a sparse memfd costs its tenant nothing, so without a
    /// bound one tenant could make memfoldd hold any amount of memory (a 256 GiB guest
    /// ~1 GiB of books) and fill the 2^31-page global page space for every other.
    /// `u64::MAX`: no bound.
    pub tenant_max_bytes: u64,
    /// The folder of enlightened guests' channel sockets (`NAME.sock` for the guest
    /// named `NAME`, QEMU's virtio-serial port `org.memfold.guest.0`; issue 17,
    /// [`crate::guest_channel`]), and how often each is asked for its pages' categories.
    /// `None`: no guest is asked; every guest is scanned as one that says nothing.
    pub guest_channels: Option<(PathBuf, Duration)>,
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
        source: std::io::Error,
    },
    /// Another memfoldd accepts connections at the socket path.
    #[error("memfoldd socket {path}: another memfoldd is listening there; stop it first")]
    Running {
        /// Socket path.
        path: PathBuf,
    },
    /// Another memfoldd holds the socket's lock file: it is starting or running there.
    #[error(
        "{path}: another memfoldd holds it (starting or running at its socket); stop it first"
    )]
    Locked {
        /// The lock file.
        path: PathBuf,
    },
    /// A backing could not be created.
    #[error(transparent)]
    Backing(#[from] BackingError),
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// Messages the peers' reader threads may have waiting for the main thread: a full queue
/// holds the readers (a flooding peer's first), never memfoldd's memory without bound.
const INPUT_QUEUE: usize = 256;

/// Most messages the main thread takes from the queue between two scan steps.
const INPUTS_A_TURN: usize = 1024;

/// A monotonic clock for the engine.
struct MonotonicClock(Instant);

impl Clock for MonotonicClock {
    fn now_us(&self) -> u64 {
        self.0.elapsed().as_micros() as u64
    }

    fn now_ns(&self) -> u64 {
        self.0.elapsed().as_nanos() as u64
    }
}

/// The daemon's state, owned by its main thread.
struct Daemon {
    engine: Engine,
    guests: Guests,
    executor: Executor,
    /// Block devices (Satori §4.1, §5.2).
    devices: devices::Devices,
    /// Each domain's pool, handed to its guests' agents (and only theirs).
    pools: BTreeMap<DomainId, OwnedFd>,
    /// The domain a new guest joins, by what keys it under `rule`.
    keys: BTreeMap<DomainKey, DomainId>,
    /// What keys each domain (several domains may share a key: a pool adopted after a
    /// restart in which a new guest of that key attached first).
    key_of: BTreeMap<DomainId, DomainKey>,
    next_domain: u32,
    /// The operator's opt-outs and opt-ins, as recorded beside the socket.
    opt_outs: opt_outs::OptOuts,
    /// Bytes guests told to leave a pool were to copy, and when each was told
    /// ([`domains::Leaving`]).
    leaving: domains::Leaving,
    rule: DomainRule,
    never_share: BTreeSet<String>,
    /// [`DaemonConfig::tenant_max_bytes`].
    tenant_max_bytes: u64,
    /// Where guests' swap files go, if memfoldd swaps (a host budget).
    swap_dir: Option<PathBuf>,
    last_reap: Instant,
    claims: balloon::Claims,
    /// Enlightened guests' channels ([`DaemonConfig::guest_channels`]).
    channels: Option<GuestChannels>,
    /// Each tenant's statistics, reused for [`crate::reused::REUSE_FOR`].
    tenant_stats: crate::reused::Reused<u32, memfold_wire::Stats>,
}

/// Runs memfoldd until killed.
///
/// Errors: the socket cannot be bound; the configuration is invalid; the pool, the store
/// or the swap file cannot be created; the engine cannot read its pool.
pub fn run(cfg: DaemonConfig) -> Result<(), DaemonError> {
    run_until(cfg, &AtomicBool::new(false))
}

/// Runs memfoldd until `stop` is set, then stops as [`serve`] does. For tests of
/// restarts within one process.
///
/// Errors: as [`run`].
pub fn run_until(cfg: DaemonConfig, stop: &AtomicBool) -> Result<(), DaemonError> {
    serve(cfg, stop, || {})
}

/// Runs memfoldd until `stop` is set; `ready` is called once the socket accepts
/// connections (for systemd's `READY=1`).
///
/// A socket file at the path is taken over if nothing listens there (a killed memfoldd's);
/// if another memfoldd answers, this one does not start ([`DaemonError::Running`]).
///
/// When `stop` is set, memfoldd stops cleanly: it plans and sends no more work, stops
/// listening, waits up to [`DRAIN_TIMEOUT`] for the answers to batches under way
/// (applying them), then closes every agent's connection and removes its socket file.
/// Pages whose answers did not come stay as the agents left them: each agent keeps
/// serving its guest's faults from the pool, store and swap file it holds, and re-attaches
/// to the next memfoldd at the socket with the list of what it maps (docs/live.md, "Crash
/// safety").
///
/// Errors: as [`run`].
pub fn serve(
    cfg: DaemonConfig,
    stop: &AtomicBool,
    ready: impl FnOnce(),
) -> Result<(), DaemonError> {
    let socket_err = |source| DaemonError::Socket {
        path: cfg.socket.clone(),
        source,
    };
    refuse_if_running(&cfg.socket)?;
    // Held until serve returns, and the socket checked again under it: two memfoldds
    // started at once (a restart and an operator's) both found the socket stale, the
    // second unlinked the first's, and each adopted the same pool, handing out its holes
    // twice.
    let _lock = lock_socket(&cfg.socket)?;
    refuse_if_running(&cfg.socket)?;
    if cfg.socket.exists() {
        tracing::info!(
            "{}: a stale socket (nothing listens): replaced",
            cfg.socket.display()
        );
    }
    let mut d = Daemon::new(&cfg)?;
    let listener = Arc::new(Listener::bind(&cfg.socket).map_err(socket_err)?);
    let bound = file_id(&cfg.socket);
    let closed = |listener: &Listener| {
        listener.shutdown();
        // Only our own socket file: not one a later memfoldd bound at the same path.
        if bound.is_some() && file_id(&cfg.socket) == bound {
            let _ = std::fs::remove_file(&cfg.socket);
        }
    };
    if let Some(gid) = cfg.agent_gid {
        if let Err(e) = Listener::share_with_group(&cfg.socket, gid) {
            closed(&listener);
            return Err(socket_err(e));
        }
    }
    let (tx, rx) = mpsc::sync_channel(INPUT_QUEUE);
    let agent_gid = cfg.agent_gid;
    let acceptor = Arc::clone(&listener);
    if let Err(e) = std::thread::Builder::new()
        .name("accept".into())
        .spawn(move || readers::accept_loop(&acceptor, tx, agent_gid))
    {
        closed(&listener);
        return Err(socket_err(e));
    }
    tracing::info!(
        "listening on {} (mode {}); agents attach there",
        cfg.socket.display(),
        if agent_gid.is_some() { "0660" } else { "0600" }
    );
    ready();
    let r = d.main_loop(&rx, stop);
    closed(&listener);
    if r.is_ok() {
        d.drain(&rx);
    }
    if let Some(c) = &mut d.channels {
        c.stop_all();
    }
    let n = d.guests.close_all();
    tracing::info!(
        "stopped: socket {} closed, {n} agents left to serve their guests until the next memfoldd",
        cfg.socket.display()
    );
    r
}

/// Refuses to start beside a memfoldd that answers at `socket`: [`serve`] checks it before
/// it binds, and memfoldd's command checks it before it takes anything else a running
/// memfoldd holds (its metrics port), so a second one is refused for the socket, and
/// leaves the first's port alone.
///
/// Errors: [`DaemonError::Running`].
pub fn refuse_if_running(socket: &Path) -> Result<(), DaemonError> {
    if memfold_wire::Conn::connect(socket).is_ok() {
        return Err(DaemonError::Running {
            path: socket.to_path_buf(),
        });
    }
    Ok(())
}

/// Takes the lock of socket path `socket` (`SOCKET.lock` beside it, made if need be,
/// never removed: a lock file unlinked can be locked twice): one memfoldd at a time
/// checks the socket, binds it and serves, for as long as the returned file is open.
///
/// Errors: [`DaemonError::Locked`] (another memfoldd holds it); [`DaemonError::Socket`]
/// (the lock file cannot be opened).
pub fn lock_socket(socket: &Path) -> Result<std::fs::File, DaemonError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut path = socket.as_os_str().to_owned();
    path.push(".lock");
    let path = PathBuf::from(path);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|source| DaemonError::Socket {
            path: path.clone(),
            source,
        })?;
    // SAFETY: flock takes a descriptor open across the call, and no pointer.
    let rc = unsafe {
        libc::flock(
            std::os::fd::AsRawFd::as_raw_fd(&file),
            libc::LOCK_EX | libc::LOCK_NB,
        )
    };
    if rc == 0 {
        return Ok(file);
    }
    let source = std::io::Error::last_os_error();
    if source.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Err(DaemonError::Locked { path });
    }
    Err(DaemonError::Socket { path, source })
}

/// A file's (device, inode), if it exists.
fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

fn dup(b: &FileBacking) -> Result<OwnedFd, BackingError> {
    b.dup().map_err(|e| BackingError::new("dup", e))
}

impl Daemon {
    fn new(cfg: &DaemonConfig) -> Result<Daemon, DaemonError> {
        let clock = Box::new(MonotonicClock(Instant::now()));
        let layouts = Arc::new(QemuLayouts::default());
        Ok(Daemon {
            engine: Engine::new(cfg.engine.clone(), clock, cfg.swap_capacity)?,
            guests: Guests::default(),
            executor: Executor::default(),
            devices: Default::default(),
            pools: BTreeMap::new(),
            keys: BTreeMap::new(),
            key_of: BTreeMap::new(),
            next_domain: 0,
            leaving: Default::default(),
            opt_outs: opt_outs::OptOuts::load(&cfg.socket, guests::process_alive),
            rule: cfg.domains,
            never_share: cfg.never_share.clone(),
            tenant_max_bytes: cfg.tenant_max_bytes,
            swap_dir: cfg.engine.host_budget.map(|_| cfg.swap_dir.clone()),
            last_reap: Instant::now(),
            claims: balloon::Claims::new(cfg.claim, cfg.allowance, Arc::clone(&layouts)),
            channels: cfg
                .guest_channels
                .as_ref()
                .map(|(dir, every)| GuestChannels::new(dir, *every, Arc::clone(&layouts))),
            tenant_stats: crate::reused::Reused::new(crate::reused::REUSE_FOR),
        })
    }

    fn main_loop(
        &mut self,
        rx: &mpsc::Receiver<Input>,
        stop: &AtomicBool,
    ) -> Result<(), DaemonError> {
        let mut busy = false;
        while !stop.load(Ordering::Relaxed) {
            let wait = Duration::from_millis(if busy { 1 } else { 50 });
            match rx.recv_timeout(wait) {
                Ok(input) => self.input(input)?,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            }
            // A budget a turn: a peer that floods must not starve the scan and the clock.
            for input in rx.try_iter().take(INPUTS_A_TURN) {
                self.input(input)?;
            }
            if let Some(c) = &mut self.channels {
                c.apply(&mut self.engine);
            }
            busy = self.engine.scan_step()?;
            self.engine.clock_step();
            self.engine.check_budget();
            self.executor.flush(&mut self.engine, &self.guests);
            self.devices.pump(&mut self.engine);
            if self.last_reap.elapsed() > Duration::from_secs(1) {
                self.last_reap = Instant::now();
                self.reap();
                // Each guest's waits on its agent, for its wait target (issue 15): the
                // agents' histograms summed only when there is a target.
                let targeted = self.engine.config().wait_target_pct.is_some();
                for (id, _, attached) in self.engine.vms() {
                    if attached && targeted {
                        let waited = self.guests.latencies(id).guest_wait_us();
                        self.engine.guest_waited(id, waited as u64);
                    }
                }
                self.claims.tick(&self.engine);
                if let Some(c) = &mut self.channels {
                    c.sync(&self.engine);
                }
            }
        }
        Ok(())
    }

    /// After a stop: applies the answers to batches under way (and answers clients) for
    /// up to [`DRAIN_TIMEOUT`], planning and sending nothing new; an agent's hello still
    /// queued is closed unanswered (it re-attaches to the next memfoldd).
    fn drain(&mut self, rx: &mpsc::Receiver<Input>) {
        let under_way = self.executor.under_way();
        tracing::info!(
            "stopping: no new work; {under_way} batches under way, waiting up to {} s for their answers",
            DRAIN_TIMEOUT.as_secs()
        );
        let until = Instant::now() + DRAIN_TIMEOUT;
        while self.executor.under_way() > 0 {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::info!(
                    "{} batches unanswered: left to the agents' re-attach",
                    self.executor.under_way()
                );
                return;
            }
            match rx.recv_timeout(left.min(Duration::from_millis(50))) {
                Ok(Input::Attach { conn, .. }) => conn.shutdown(),
                Ok(input) => {
                    if let Err(e) = self.input(input) {
                        tracing::warn!("while stopping: {e}");
                        return;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn input(&mut self, input: Input) -> Result<(), DaemonError> {
        match input {
            Input::Attach {
                token,
                conn,
                hello,
                fds,
                pid,
                uid,
            } => self.attach(token, conn, hello, fds, pid, uid),
            Input::Agent { token, msg } => {
                if let Some(vm) = self.guests.vm_of(token) {
                    self.agent_message(vm, msg);
                }
            }
            Input::Gone { token } => {
                if let Some(vm) = self.guests.gone(token) {
                    tracing::info!("{vm}: its agent disconnected; detached");
                    self.executor.lost(&mut self.engine, vm);
                    self.engine.detach(vm);
                    self.reap();
                }
            }
            Input::DeviceHello {
                token,
                conn,
                bases,
                pid,
                pidfd,
            } => {
                self.devices.hello(token, conn, bases, (pid, pidfd));
                self.devices
                    .forget_unused_bases(|| self.engine.indexed_disks());
            }
            Input::Device { token, msg } => {
                self.devices
                    .message(&mut self.engine, &mut self.guests, token, msg)
            }
            Input::DeviceGone { token } => self.devices.gone(token),
            Input::Client {
                reply,
                msg,
                operator,
                uid,
            } => {
                let answer = match msg {
                    ToDaemon::Stats => {
                        // A tenant sees its own guests only (test `access.rs`), from a copy
                        // at most a second old: its requests cannot keep the main loop
                        // reading every guest's books (`crate::reused`).
                        let (engine, guests, claims) = (&self.engine, &self.guests, &self.claims);
                        let channels = &self.channels;
                        let fresh = |viewer| {
                            let mut stats = books::stats(engine, guests, claims, viewer);
                            if let Some(c) = channels {
                                c.fill(&mut stats.vms);
                            }
                            stats
                        };
                        let stats = if operator {
                            fresh(None)
                        } else {
                            self.tenant_stats
                                .get_or(uid, Instant::now(), || fresh(Some(uid)))
                        };
                        ToClient::Stats(Box::new(stats))
                    }
                    // Counts content across every guest, whatever its domain: whether a
                    // page the asker wrote in its own guest moves the counts tells it
                    // whether another tenant holds that page. Operators only.
                    ToDaemon::Census if !operator => ToClient::Error {
                        message: "only root or memfoldd's user may take a census".into(),
                    },
                    ToDaemon::Census => {
                        let c = self.engine.census();
                        ToClient::Census(memfold_wire::CensusStats {
                            pages: c.pages,
                            zero_pages: c.zero_pages,
                            unknown_pages: c.unknown_pages,
                            distinct: c.distinct(),
                            duplicate_pages: c.duplicate_pages(),
                        })
                    }
                    ToDaemon::OptOut { name, out } if operator => self.opt_out(&name, out),
                    ToDaemon::OptOut { .. } => ToClient::Error {
                        message: "only root or memfoldd's user may opt a guest out or in".into(),
                    },
                    // Its kind only: the request's content is the peer's, up to a
                    // message long (its Debug text could outgrow the answer).
                    other => ToClient::Error {
                        message: format!("unexpected request of kind {}", other.kind()),
                    },
                };
                let _ = reply.send(answer);
            }
        }
        Ok(())
    }

    /// The operator's opt-out (or opt-in) of the guests named `name`.
    fn opt_out(&mut self, name: &str, out: bool) -> ToClient {
        let ids = self.engine.vms_named(name);
        if ids.is_empty() {
            return ToClient::Error {
                message: format!("no guest named {name:?}"),
            };
        }
        // Recorded first: once answered, it holds across a restart of memfoldd even if
        // the agent never hears of it (`opt_outs.rs`).
        let keys = ids
            .iter()
            .filter_map(|id| self.guests.by_vm.get(id))
            .map(|g| (g.pid, g.ram_id, g.name.clone()))
            .collect();
        let recorded = self.opt_outs.set(keys, out);
        let mut pages = 0;
        for id in ids {
            if out {
                pages += self.engine.opt_out(id).unwrap_or(0);
            } else {
                self.engine.opt_in(id);
            }
            // The agent carries it to a restarted memfoldd. With no connection now, the
            // re-attach tells it (`attach`).
            if let Some(c) = self.guests.conn(id) {
                c.send_state(ToAgent::OptedOut { out });
            }
        }
        match recorded {
            Ok(()) => ToClient::OptedOut { pages },
            Err(e) => ToClient::Error {
                message: format!(
                    "{} (with {pages} pages to take back), but {e}: a restart of memfoldd \
                     before the guest's agent hears of it may undo it",
                    if out { "opted out" } else { "opted in" }
                ),
            },
        }
    }

    /// Releases detached guests whose QEMU has exited or unmapped their region; ends each
    /// domain's adoption of a pool once no process but attached guests' QEMUs holds it,
    /// every RAM region of each re-attached ([`adoption`]); forgets domains the engine
    /// dropped (no guest, no frame).
    fn reap(&mut self) {
        let mut released = Vec::new();
        for (vm, why) in self.guests.released() {
            tracing::info!("{}", self.guests.release_line(vm, why));
            if let Some(g) = self.guests.by_vm.get(&vm) {
                released.push((g.pid, g.ram_id, g.name.clone()));
            }
            self.engine.remove(vm);
            self.guests.remove(vm);
        }
        self.opt_outs.forget(&released);
        let attached: Vec<u32> = self
            .engine
            .vms()
            .into_iter()
            .filter(|v| v.2)
            .map(|v| v.1)
            .collect();
        let rams = self.guests.attached_rams();
        for (&d, pool) in &self.pools {
            if !self.engine.adoption_pending(d) {
                continue;
            }
            let Ok((dev, ino)) = memfd::file_id(pool.as_fd()) else {
                continue;
            };
            // Unknown holders (a /proc entry memfoldd cannot read) keep the adoption:
            // ending it early would free frames a QEMU may still map — so does a QEMU of
            // which a RAM region has not re-attached yet (`adoption.rs`).
            if guests::holders(dev, ino).is_some_and(|h| {
                adoption::every_holder_reattached(&h, &attached, &rams, adoption::ram_regions)
            }) {
                tracing::info!(
                    "{d}: every holder of the adopted pool has re-attached: adoption ends"
                );
                self.engine.end_adoption(d);
            }
        }
        for &d in self.pools.keys() {
            self.engine.drop_domain_if_empty(d);
        }
        let engine = &self.engine;
        self.pools.retain(|d, _| engine.has_domain(*d));
        let pools = &self.pools;
        self.keys.retain(|_, d| pools.contains_key(d));
        self.key_of.retain(|d, _| pools.contains_key(d));
        // New guests of a key whose domain went join another domain of that key.
        for (&d, &k) in &self.key_of {
            self.keys.entry(k).or_insert(d);
        }
    }
}
