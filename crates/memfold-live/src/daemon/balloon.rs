//! Claiming sharing entitlements through each guest's virtio balloon (Satori §4.2), and
//! repaying them when sharing breaks (§4.3).
//!
//! Every second the main loop sets each guest's target — allowance + entitlement, by the
//! claim policy ([`memfold_core::claim_target`]) — and hands it to that guest's claimer,
//! a thread of its own that talks to the guest's QEMU monitor (QMP `balloon`,
//! `query-balloon`). The engine never waits on a guest: a claimer that is slow, stuck or
//! refused only leaves its own guest's balloon where it is.
//!
//! Which monitor: memfoldd's own, the one QEMU's command line names ([`crate::monitor`]).
//! *Invariant: a claimer drives only the balloon of the QEMU it claims for*: it connects
//! only to a socket whose listening end the kernel says that QEMU made (`SO_PEERCRED`,
//! [`Qmp::connect_served_by`]), else it drives nothing and says why. As it connects it
//! asks QEMU where the guest's RAM lies, for the guest channel ([`QemuLayouts`]), which
//! cannot open the monitor while the claimer holds it.
//!
//! *Invariant: a claimer belongs to one QEMU process*, known by its pid and its start
//! time (`monitor::started`): a QEMU that exits and whose pid a new QEMU takes
//! before the next second gets a claimer of its own, not the old one's asks (below) and
//! target.
//!
//! Per guest: a QEMU started with `MEMFOLD_CLAIM=never|allowance-only|under-pressure|at-once` or
//! `MEMFOLD_ALLOWANCE_MIB=N` in its environment (read from `/proc/PID/environ` by its
//! claimer's thread as it starts, never by the main loop: the kernel reads it from the
//! QEMU's memory, which the QEMU may back with a file that never answers; no target is
//! set until it is read) asks for a policy or an allowance of its own. memfoldd's flags are the
//! ceiling: a guest may ask for less, never more — the environment is the peer's to write
//! as much as its command line, and this way it can only cost its own guest memory.
//!
//! After a memfoldd restart the books are rebuilt as agents re-attach, one by one: until
//! a guest's sharing partners are back, its frames count fewer mappers and its
//! entitlement reads too low. *Invariant: no target is set from half-rebuilt books*,
//! for a while: while a sharing domain of a QEMU's guests still adopts the previous
//! memfoldd's pool ([`Engine::adoption_pending`]), a claimer whose policy reads the books
//! (`at-once`, `under-pressure`) sends no target (it connects and reads the balloon),
//! and QEMU keeps the last memfoldd's — for at most `ADOPTION_GRACE` (120 s): an adoption lasts
//! as long as one holder of the pool has not re-attached (a QEMU paused on a failure, a
//! re-attach refused), and every guest of the domain would go unclaimed and unrepaid.
//! Then the books are read as they stand, and the log says why. A claimer that has set no target starts
//! from what the balloon leaves the guest: under `under-pressure` a guest that had grown
//! past its allowance is not cut back to it, and nothing is set until that is known.
//!
//! Repayment needs no second rule: when a CoW break lowers a page's sharing rank, the
//! entitlement of every guest still mapping that frame falls, their targets fall with it
//! at the next second and their balloons inflate — the guests whose sharing broke, and
//! no other. Until a balloon catches up, the host budget's swap (DE §4.6) covers the
//! difference, so no fault waits on a guest. A guest that deflated its balloon rather
//! than run out of memory (`deflate-on-oom`) inflates it again only when QEMU tells its
//! driver of a new target, which QEMU does once per `balloon` command: so a claimer asks
//! again, at most once every `IGNORED_AFTER` (30 s), while the balloon leaves the guest more
//! than its target and the guest is not short of memory.
//!
//! A claimer whose thread cannot start (the host out of threads) is not kept: the
//! failure is logged and the claimer started again at the next second.

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use memfold_core::engine::Engine;
use memfold_core::{claim_target, short_of_memory, ClaimPolicy};
use memfold_vm::qmp::Qmp;

use crate::monitor::{open_monitor, started, QemuLayouts};

/// How long a claimer waits before it tries a monitor again after an error.
const RETRY: Duration = Duration::from_secs(5);

/// How long a claimer waits on its monitor for one answer.
const MONITOR_TIMEOUT: Duration = Duration::from_secs(2);

/// A balloon that has not come within 1 MiB of its target after this long is reported as
/// ignoring requests; a balloon that leaves its guest more than its target is asked again
/// at most this often ([`Pace::ask_again_after`]).
const IGNORED_AFTER: Duration = Duration::from_secs(30);

/// Most characters of a balloon's problem as memfoldd keeps and shows it: room for its
/// own longest (~180) with a path or a QEMU's short error in it.
const PROBLEM_CHARS: usize = 400;

/// A balloon less than this from its target counts as there, bytes.
const NEAR: u64 = 1 << 20;

/// How a claimer paces its guest's balloon.
#[derive(Clone, Copy, Debug)]
struct Pace {
    /// How often it reads the balloon back and takes new targets.
    poll: Duration,
    /// How long after its last `balloon` command it asks again for the same target, while
    /// the balloon leaves the guest more than [`NEAR`] above it and the guest is not short.
    ask_again_after: Duration,
}

/// The pace of memfoldd's claimers: the balloon read every second, a deflated target
/// asked again every [`IGNORED_AFTER`] at most.
const PACE: Pace = Pace {
    poll: Duration::from_secs(1),
    ask_again_after: IGNORED_AFTER,
};

/// How a guest's balloon stands, as its claimer last saw it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BalloonState {
    /// The target set last (allowance + what it may claim), bytes.
    pub target: Option<u64>,
    /// What the balloon leaves the guest (`query-balloon`'s `actual`), bytes.
    pub actual: Option<u64>,
    /// Why the balloon is not driven, or lags (no monitor, no balloon driver, a balloon
    /// that ignores requests); `None` while all is well.
    pub problem: Option<String>,
    /// Memory available to the guest (its balloon driver's `stat-available-memory`),
    /// bytes; `None`: not reported.
    pub available: Option<u64>,
    /// Whether the guest is short of memory ([`memfold_core::short_of_memory`]);
    /// `None`: not known.
    pub short: Option<bool>,
    /// The claim policy and allowance (bytes) its QEMU runs under: the host's, or less if
    /// its environment asked ([`guest_asks`]); `None` until the claimer has read it.
    pub asks: Option<(ClaimPolicy, u64)>,
    /// The guest's RAM as its QEMU's monitor says (`query-memory-size-summary`, asked
    /// as the claimer connects), bytes; `None`: not said. The claim's ceiling when it is
    /// more than the regions memfoldd manages (one refused, or not re-attached yet).
    pub qemu_ram: Option<u64>,
}

/// One guest's claimer: the thread's inbox and what it reports.
struct Claimer {
    /// When its QEMU started (clock ticks after boot, [`started`]): with the pid, the QEMU
    /// it claims for.
    started: u64,
    targets: mpsc::Sender<u64>,
    state: Arc<Mutex<BalloonState>>,
    /// The target sent last, bytes (`None`: none yet).
    target: Option<u64>,
    /// Its policy and allowance (bytes): the host's, or less if the guest asked
    /// ([`guest_asks`]); `None` until its thread has read its QEMU's environment.
    asks: Option<(ClaimPolicy, u64)>,
    /// Since when a domain of its guests has been adopting a previous memfoldd's pool, as
    /// this claimer saw it (`None`: not adopting).
    adopting_since: Option<Instant>,
}

/// How long a claimer whose policy reads the books waits for an adoption to end before
/// it sets targets all the same: an adoption can last as long as one holder of the pool
/// never re-attaches (a QEMU paused on a failure, a re-attach refused), and every guest
/// of that domain — every guest of a user, by default — would go unclaimed and unrepaid.
const ADOPTION_GRACE: Duration = Duration::from_secs(120);

/// What a QEMU's environment (NUL-separated `KEY=value`s) asks for: a claim policy
/// (`MEMFOLD_CLAIM`) and an allowance in bytes (`MEMFOLD_ALLOWANCE_MIB`), each `None`
/// when unset; a value that does not parse is an error naming it.
pub fn guest_asks(environ: &[u8]) -> Result<(Option<ClaimPolicy>, Option<u64>), String> {
    let (mut policy, mut allowance) = (None, None);
    for kv in environ.split(|&b| b == 0) {
        let Ok(kv) = std::str::from_utf8(kv) else {
            continue;
        };
        match kv.split_once('=') {
            Some(("MEMFOLD_CLAIM", v)) => policy = Some(v.parse::<ClaimPolicy>()?),
            Some(("MEMFOLD_ALLOWANCE_MIB", v)) => {
                let mib: u64 = v.parse().map_err(|_| {
                    format!("MEMFOLD_ALLOWANCE_MIB={v:?}: expected MiB, a whole number")
                })?;
                allowance = Some(mib.saturating_mul(1 << 20));
            }
            _ => {}
        }
    }
    Ok((policy, allowance))
}

/// The policy and allowance (bytes) QEMU `pid` claims under: the host's `(policy,
/// allowance)`, or less if its environment (read with `environ`) asks.
fn asks_of(
    pid: u32,
    host: (ClaimPolicy, u64),
    environ: fn(u32) -> std::io::Result<Vec<u8>>,
) -> (ClaimPolicy, u64) {
    let asked = environ(pid)
        .map_err(|e| format!("cannot read its environment: {e}"))
        .and_then(|env| guest_asks(&env));
    let (policy, allowance) = match asked {
        Ok((p, a)) => (
            p.map_or(host.0, |p| p.at_most(host.0)),
            a.map_or(host.1, |a| a.min(host.1)),
        ),
        Err(why) => {
            // Its environment's words: shown escaped and short.
            let why = memfold_wire::shown_within(&why, PROBLEM_CHARS);
            tracing::warn!("QEMU pid {pid}: {why}; the host's claim policy applies");
            host
        }
    };
    if (policy, allowance) != host {
        tracing::info!(
            "QEMU pid {pid} asks to claim {policy:?} over an allowance of {} MiB",
            allowance >> 20
        );
    }
    (policy, allowance)
}

/// The claimers of all guests, and the policy they follow.
///
/// A balloon belongs to a QEMU, not to a RAM region: a guest whose RAM is several
/// regions (NUMA nodes, hot-plugged memory: one engine guest each, `NAME/ramK`) has one
/// claimer, keyed by QEMU's pid and start time, for the sum of its regions' RAM and
/// entitlements.
pub(crate) struct Claims {
    policy: ClaimPolicy,
    /// Each guest's base allowance, bytes.
    allowance: u64,
    /// By QEMU's pid; each claimer knows its QEMU's start time ([`Claimer::started`]).
    by_qemu: BTreeMap<u32, Claimer>,
    /// Where each claimer keeps its QEMU's RAM layout as it connects.
    layouts: Arc<QemuLayouts>,
    /// The claimer threads' stack, bytes (`None`: the standard library's default). Only a
    /// test sets it: to a size no thread can have, to see a spawn fail.
    stack: Option<usize>,
    /// Reads a QEMU's environment (`/proc/PID/environ`); only a test replaces it.
    environ: fn(u32) -> std::io::Result<Vec<u8>>,
    /// [`ADOPTION_GRACE`]; only a test shortens it.
    adoption_grace: Duration,
}

/// `/proc/PID/environ`. The kernel reads it from the QEMU's own memory, which a QEMU can
/// back with a file of a FUSE server that never answers: only a claimer's thread reads
/// it, never the main loop.
fn proc_environ(pid: u32) -> std::io::Result<Vec<u8>> {
    std::fs::read(format!("/proc/{pid}/environ"))
}

/// One QEMU as the books stand this second.
#[derive(Default)]
struct Qemu {
    /// Its regions' RAM, bytes.
    ram: u64,
    /// Its regions' entitlement, pages.
    entitlement_pages: f64,
    /// Whether a sharing domain of its regions still adopts a previous memfoldd's pool
    /// (the books half rebuilt).
    adopting: bool,
}

impl Claims {
    /// Claims under `policy`, each guest allowed `allowance` bytes before entitlement;
    /// the claimers keep their QEMUs' RAM layouts in `layouts`.
    pub(crate) fn new(policy: ClaimPolicy, allowance: u64, layouts: Arc<QemuLayouts>) -> Claims {
        Claims {
            policy,
            allowance,
            by_qemu: BTreeMap::new(),
            layouts,
            stack: None,
            environ: proc_environ,
            adoption_grace: ADOPTION_GRACE,
        }
    }

    /// Sets every guest's target from its entitlement now; starts a claimer for a QEMU
    /// new to it, ends those of QEMUs gone (a pid now another QEMU's included). Sends no
    /// target from the books to a QEMU while a sharing domain of its guests adopts a
    /// previous memfoldd's pool, for up to [`ADOPTION_GRACE`]. Called once a second.
    pub(crate) fn tick(&mut self, engine: &Engine) {
        if self.policy == ClaimPolicy::Never {
            return;
        }
        let mut qemus: BTreeMap<u32, Qemu> = BTreeMap::new();
        // Every guest's at once: one guest's alone walks its whole domain.
        let mut ranks = engine.all_sharing_ranks();
        // Once a domain: the question walks its frame table.
        let mut pending = BTreeMap::new();
        for (id, pid, _) in engine.vms() {
            let q = qemus.entry(pid).or_default();
            q.ram += engine.ram_bytes(id).unwrap_or(0);
            q.entitlement_pages += ranks.remove(&id).unwrap_or_default().entitlement_pages();
            q.adopting |= engine.domain_of(id).is_some_and(|d| {
                *pending
                    .entry(d)
                    .or_insert_with(|| engine.adoption_pending(d))
            });
        }
        // A QEMU gone has no start time; its guests go at the next reap.
        let started: BTreeMap<u32, u64> = qemus
            .keys()
            .filter_map(|&pid| Some((pid, started(pid)?)))
            .collect();
        self.by_qemu
            .retain(|pid, c| started.get(pid) == Some(&c.started));
        for (pid, q) in qemus {
            let Some(&at) = started.get(&pid) else {
                continue;
            };
            if !self.by_qemu.contains_key(&pid) {
                match self.start(pid, at) {
                    Ok(c) => {
                        self.by_qemu.insert(pid, c);
                    }
                    Err(e) => {
                        tracing::warn!(
                            "QEMU pid {pid}: cannot start its balloon claimer ({e}); its balloon is not driven, tried again in a second"
                        );
                        continue;
                    }
                }
            }
            let claimer = self.by_qemu.get_mut(&pid).expect("kept or inserted above");
            let (short, actual, asks, qemu_ram) = claimer
                .state
                .lock()
                .map(|s| (s.short, s.actual, s.asks, s.qemu_ram))
                .unwrap_or_default();
            claimer.asks = claimer.asks.or(asks);
            // What its QEMU asks is read by its thread: nothing is set until it is known.
            let Some((policy, allowance)) = claimer.asks else {
                continue;
            };
            // Half-rebuilt books: a policy that reads them waits, for a while.
            let reads_books = matches!(policy, ClaimPolicy::AtOnce | ClaimPolicy::UnderPressure);
            if !q.adopting {
                claimer.adopting_since = None;
            } else if reads_books {
                let since = *claimer.adopting_since.get_or_insert_with(Instant::now);
                if since.elapsed() < self.adoption_grace {
                    tracing::debug!("QEMU pid {pid}: its books are rebuilt as agents re-attach; no balloon target until then");
                    continue;
                }
                if since.elapsed() < self.adoption_grace + PACE.poll {
                    tracing::warn!(
                        "QEMU pid {pid}: a previous memfoldd's pool is still adopted after {} s (a holder of it has not re-attached): its balloon is driven from the books as they stand",
                        self.adoption_grace.as_secs()
                    );
                }
            }
            // The ceiling: the guest's RAM. Its regions memfoldd manages may be fewer than
            // it has (one refused, one not re-attached yet); its QEMU's word can only raise
            // the ceiling to a target QEMU clamps anyway, never lower it.
            let ceiling = q.ram.max(qemu_ram.unwrap_or(0));
            let Some(t) = claim_target(
                policy,
                ceiling,
                allowance,
                q.entitlement_pages,
                claimer.target.or(actual),
                short,
            ) else {
                continue;
            };
            if claimer.target != Some(t) {
                claimer.target = Some(t);
                let _ = claimer.targets.send(t);
            }
        }
    }

    /// A claimer for QEMU `pid`, started at `started` (clock ticks after boot), its thread
    /// running; the thread first reads what the QEMU's environment asks ([`asks_of`]).
    ///
    /// Errors: the thread could not be spawned.
    fn start(&self, pid: u32, started: u64) -> std::io::Result<Claimer> {
        let (tx, rx) = mpsc::channel();
        let state = Arc::new(Mutex::new(BalloonState::default()));
        let mut thread = std::thread::Builder::new().name(format!("balloon-{pid}"));
        if let Some(bytes) = self.stack {
            thread = thread.stack_size(bytes);
        }
        let host = (self.policy, self.allowance);
        let environ = self.environ;
        thread.spawn({
            let layouts = Arc::clone(&self.layouts);
            let s = Arc::clone(&state);
            move || {
                let asks = asks_of(pid, host, environ);
                if let Ok(mut s) = s.lock() {
                    s.asks = Some(asks);
                }
                claim_loop(pid, rx, s, &layouts)
            }
        })?;
        Ok(Claimer {
            started,
            targets: tx,
            state,
            target: None,
            asks: None,
            adopting_since: None,
        })
    }

    /// The balloon of the QEMU with `pid` as last seen (`None`: not driven).
    pub(crate) fn state(&self, pid: u32) -> Option<BalloonState> {
        let c = self.by_qemu.get(&pid)?;
        let s = c.state.lock().map(|s| s.clone()).unwrap_or_default();
        Some(s)
    }
}

/// What a claimer tells the main loop: its guest's [`BalloonState`], and its problem,
/// logged once each time it changes.
struct Reporter {
    pid: u32,
    state: Arc<Mutex<BalloonState>>,
    said: Option<String>,
    /// Since when the balloon has been 1 MiB or more off its target (kept across
    /// reconnections).
    off_target_since: Option<Instant>,
}

impl Reporter {
    fn report(&self, f: impl FnOnce(&mut BalloonState)) {
        if let Ok(mut s) = self.state.lock() {
            f(&mut s);
        }
    }

    /// Says the balloon's problem (`None`: all is well). The text may quote the QEMU's
    /// monitor (its error's `desc`, a line it sent): it is shown escaped and at most
    /// [`PROBLEM_CHARS`] long, in the log and in every reader's statistics.
    fn problem(&mut self, why: Option<String>) {
        let why = why.map(|w| memfold_wire::shown_within(&w, PROBLEM_CHARS));
        if why.is_some() && why != self.said {
            tracing::warn!(
                "balloon of QEMU pid {}: {}",
                self.pid,
                why.as_deref().unwrap_or("")
            );
        }
        self.said.clone_from(&why);
        self.report(|s| s.problem = why);
    }
}

/// One guest's claimer: connects to its QEMU's monitor (checked to be that QEMU's), sets
/// each new target, reads the balloon back every second; on any error says why and tries
/// again after [`RETRY`]; ends when the main loop drops its inbox.
fn claim_loop(
    pid: u32,
    targets: mpsc::Receiver<u64>,
    state: Arc<Mutex<BalloonState>>,
    layouts: &QemuLayouts,
) {
    let mut r = Reporter {
        pid,
        state,
        said: None,
        off_target_since: None,
    };
    let mut target: Option<u64> = None;
    loop {
        let why = match open_monitor(pid, MONITOR_TIMEOUT, None) {
            Ok(mut q) => {
                // Costs only the guest channel its exact layout (it infers one).
                if let Err(why) = layouts.ask(pid, &mut q) {
                    let why = memfold_wire::shown(&why);
                    tracing::debug!("QEMU pid {pid}: no RAM layout: {why}");
                }
                match drive(q, &targets, &mut target, &mut r, PACE) {
                    Ok(()) => return,
                    Err(why) => why,
                }
            }
            Err(why) => why,
        };
        r.problem(Some(why));
        if wait_for_target(&targets, RETRY, &mut target).is_none() {
            return;
        }
    }
}

/// Drives the balloon through monitor `q` until the main loop drops its inbox (`Ok`) or
/// the monitor fails (`Err`: why): sets each new target, reads the balloon back every
/// `pace.poll`, and asks again for a target the balloon has deflated past (see the
/// module: `deflate-on-oom`). A question QEMU may refuse without harm (its RAM, the
/// balloon's statistics) is passed over when refused; but once an exchange failed half
/// way (a timeout: its answer may still come) the session is given up at once, for
/// `claim_loop` to connect anew, never asked again.
fn drive(
    q: Qmp,
    targets: &mpsc::Receiver<u64>,
    target: &mut Option<u64>,
    r: &mut Reporter,
    pace: Pace,
) -> Result<(), String> {
    let ended = drive_session(q, targets, target, r, pace);
    // What the guest said of its memory held for this session only: kept, it would claim
    // under pressure on stale words every second until a session reads them anew.
    r.report(|s| {
        s.available = None;
        s.short = None;
    });
    ended
}

/// [`drive`]'s session, until the main loop or the monitor ends it.
fn drive_session(
    mut q: Qmp,
    targets: &mpsc::Receiver<u64>,
    target: &mut Option<u64>,
    r: &mut Reporter,
    pace: Pace,
) -> Result<(), String> {
    // The target sent last on this monitor, and when.
    let mut set: Option<u64> = None;
    let mut set_at = Instant::now();
    // The balloon and the guest as last read (bytes; short of memory).
    let (mut actual, mut short): (Option<u64>, Option<bool>) = (None, None);
    // The guest's RAM, all of it: the claim's ceiling (a QEMU that does not say keeps
    // the regions' sum).
    if let Ok(bytes) = q.memory_size() {
        r.report(|s| s.qemu_ram = Some(bytes));
    }
    in_step(&q)?;
    // The guest's own view of its memory, for claiming under pressure; a balloon
    // without statistics only leaves `short` unknown.
    let stats_at = q
        .balloon_path()
        .ok()
        .flatten()
        .filter(|p| q.balloon_stats_every(p, 1).is_ok());
    in_step(&q)?;
    loop {
        if let Some(t) = *target {
            // The guest deflated past its target (on OOM) and is no longer short: its
            // driver inflates again only at a new `balloon` command.
            let ask_again = set == Some(t)
                && actual.is_some_and(|a| a > t.saturating_add(NEAR))
                && short != Some(true)
                && set_at.elapsed() >= pace.ask_again_after;
            if set != Some(t) || ask_again {
                q.balloon(t)
                    .map_err(|e| format!("balloon to {} MiB: {e}", t >> 20))?;
                set = Some(t);
                set_at = Instant::now();
                r.report(|s| s.target = Some(t));
            }
        }
        let now = q
            .balloon_actual()
            .map_err(|e| format!("query-balloon: {e}"))?;
        actual = Some(now);
        r.report(|s| s.actual = Some(now));
        let off = set.is_some_and(|t| now.abs_diff(t) >= NEAR);
        let since = *r.off_target_since.get_or_insert_with(Instant::now);
        if !off {
            r.off_target_since = None;
            r.problem(None);
        } else if since.elapsed() > IGNORED_AFTER {
            let why = if set.is_some_and(|t| now > t) {
                " (above it: the guest deflated rather than run out of memory)"
            } else {
                ""
            };
            r.problem(Some(format!(
                "ignores requests: asked for {} MiB, has {} MiB for {} s{why}; no entitlement reaches it, none is repaid from it",
                set.unwrap_or(0) >> 20,
                now >> 20,
                since.elapsed().as_secs()
            )));
        }
        if let Some(p) = &stats_at {
            let (available, total) = q.balloon_guest_memory(p).unwrap_or((None, None));
            in_step(&q)?;
            short = short_of_memory(available, total);
            r.report(|s| {
                s.available = available;
                s.short = short;
            });
        }
        if wait_for_target(targets, pace.poll, target).is_none() {
            return Ok(());
        }
    }
}

/// `Err` (why, in words) once session `q` had an exchange fail half way: its answers may
/// come late, so it is dropped and the monitor connected anew.
fn in_step(q: &Qmp) -> Result<(), String> {
    match q.unusable() {
        Some(why) => Err(format!("monitor out of step, reconnecting: {why}")),
        None => Ok(()),
    }
}

/// Waits up to `wait` for new targets, keeping the latest in `target`. `None`: the main
/// loop is gone (the guest left).
fn wait_for_target(
    targets: &mpsc::Receiver<u64>,
    wait: Duration,
    target: &mut Option<u64>,
) -> Option<()> {
    match targets.recv_timeout(wait) {
        Ok(t) => *target = Some(t),
        Err(mpsc::RecvTimeoutError::Timeout) => return Some(()),
        Err(mpsc::RecvTimeoutError::Disconnected) => return None,
    }
    while let Ok(t) = targets.try_recv() {
        *target = Some(t);
    }
    Some(())
}

#[cfg(test)]
mod tests;
