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
//! Per guest: a QEMU started with `MEMFOLD_CLAIM=never|allowance-only|under-pressure|at-once` or
//! `MEMFOLD_ALLOWANCE_MIB=N` in its environment (read from `/proc/PID/environ` when its
//! claimer starts) asks for a policy or an allowance of its own. memfoldd's flags are the
//! ceiling: a guest may ask for less, never more — the environment is the peer's to write
//! as much as its command line, and this way it can only cost its own guest memory.
//!
//! Repayment needs no second rule: when a CoW break lowers a page's sharing rank, the
//! entitlement of every guest still mapping that frame falls, their targets fall with it
//! at the next second and their balloons inflate — the guests whose sharing broke, and
//! no other. Until a balloon catches up, the host budget's swap (DE §4.6) covers the
//! difference, so no fault waits on a guest.

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use memfold_core::engine::Engine;
use memfold_core::{claim_target, short_of_memory, ClaimPolicy};
use memfold_vm::qmp::Qmp;

use crate::monitor::{open_monitor, QemuLayouts};

/// How long a claimer waits before it tries a monitor again after an error.
const RETRY: Duration = Duration::from_secs(5);

/// How long a claimer waits on its monitor for one answer.
const MONITOR_TIMEOUT: Duration = Duration::from_secs(2);

/// A balloon that has not come within 1 MiB of its target after this long is reported as
/// ignoring requests.
const IGNORED_AFTER: Duration = Duration::from_secs(30);

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
}

/// One guest's claimer: the thread's inbox and what it reports.
struct Claimer {
    targets: mpsc::Sender<u64>,
    state: Arc<Mutex<BalloonState>>,
    target: Option<u64>,
    /// Its policy: the host's, or less if the guest asked ([`guest_asks`]).
    policy: ClaimPolicy,
    /// Its allowance, bytes: the host's, or less if the guest asked.
    allowance: u64,
}

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

/// The claimers of all guests, and the policy they follow.
///
/// A balloon belongs to a QEMU, not to a RAM region: a guest whose RAM is several
/// regions (NUMA nodes, hot-plugged memory: one engine guest each, `NAME/ramK`) has one
/// claimer, keyed by QEMU's pid, for the sum of its regions' RAM and entitlements.
pub(crate) struct Claims {
    policy: ClaimPolicy,
    /// Each guest's base allowance, bytes.
    allowance: u64,
    by_qemu: BTreeMap<u32, Claimer>,
    /// Where each claimer keeps its QEMU's RAM layout as it connects.
    layouts: Arc<QemuLayouts>,
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
        }
    }

    /// Sets every guest's target from its entitlement now; starts a claimer for a guest
    /// new to it, ends those of guests gone. Called once a second.
    pub(crate) fn tick(&mut self, engine: &Engine) {
        if self.policy == ClaimPolicy::Never {
            return;
        }
        // Per QEMU: its regions' RAM, bytes, and entitlement, pages.
        let mut qemus: BTreeMap<u32, (u64, f64)> = BTreeMap::new();
        for (id, pid, _) in engine.vms() {
            let q = qemus.entry(pid).or_default();
            q.0 += engine.ram_bytes(id).unwrap_or(0);
            q.1 += engine
                .sharing_ranks(id)
                .unwrap_or_default()
                .entitlement_pages();
        }
        self.by_qemu.retain(|pid, _| qemus.contains_key(pid));
        for (pid, (ram, entitlement_pages)) in qemus {
            let claimer = self.by_qemu.entry(pid).or_insert_with(|| {
                let (tx, rx) = mpsc::channel();
                let state = Arc::new(Mutex::new(BalloonState::default()));
                let s = Arc::clone(&state);
                let _ = std::thread::Builder::new()
                    .name(format!("balloon-{pid}"))
                    .spawn({
                        let layouts = Arc::clone(&self.layouts);
                        move || claim_loop(pid, rx, s, &layouts)
                    });
                let asked = std::fs::read(format!("/proc/{pid}/environ"))
                    .map_err(|e| format!("cannot read its environment: {e}"))
                    .and_then(|env| guest_asks(&env));
                let (policy, allowance) = match asked {
                    Ok((p, a)) => (
                        p.map_or(self.policy, |p| p.at_most(self.policy)),
                        a.map_or(self.allowance, |a| a.min(self.allowance)),
                    ),
                    Err(why) => {
                        tracing::warn!("QEMU pid {pid}: {why}; the host's claim policy applies");
                        (self.policy, self.allowance)
                    }
                };
                if (policy, allowance) != (self.policy, self.allowance) {
                    tracing::info!(
                        "QEMU pid {pid} asks to claim {policy:?} over an allowance of {} MiB",
                        allowance >> 20
                    );
                }
                Claimer {
                    targets: tx,
                    state,
                    target: None,
                    policy,
                    allowance,
                }
            });
            let short = claimer.state.lock().ok().and_then(|s| s.short);
            let Some(t) = claim_target(
                claimer.policy,
                ram,
                claimer.allowance,
                entitlement_pages,
                claimer.target,
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

    fn problem(&mut self, why: Option<String>) {
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
        let why = match open_monitor(pid, MONITOR_TIMEOUT) {
            Ok(mut q) => {
                // Costs only the guest channel its exact layout (it infers one).
                if let Err(why) = layouts.ask(pid, &mut q) {
                    tracing::debug!("QEMU pid {pid}: no RAM layout: {why}");
                }
                match drive(q, &targets, &mut target, &mut r) {
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
/// the monitor fails (`Err`: why).
fn drive(
    mut q: Qmp,
    targets: &mpsc::Receiver<u64>,
    target: &mut Option<u64>,
    r: &mut Reporter,
) -> Result<(), String> {
    let mut set: Option<u64> = None;
    // The guest's own view of its memory, for claiming under pressure; a balloon
    // without statistics only leaves `short` unknown.
    let stats_at = q
        .balloon_path()
        .ok()
        .flatten()
        .filter(|p| q.balloon_stats_every(p, 1).is_ok());
    loop {
        if let Some(t) = target.filter(|&t| set != Some(t)) {
            q.balloon(t)
                .map_err(|e| format!("balloon to {} MiB: {e}", t >> 20))?;
            set = Some(t);
            r.report(|s| s.target = Some(t));
        }
        let actual = q
            .balloon_actual()
            .map_err(|e| format!("query-balloon: {e}"))?;
        r.report(|s| s.actual = Some(actual));
        let off = set.is_some_and(|t| actual.abs_diff(t) >= 1 << 20);
        let since = *r.off_target_since.get_or_insert_with(Instant::now);
        if !off {
            r.off_target_since = None;
            r.problem(None);
        } else if since.elapsed() > IGNORED_AFTER {
            let why = if set.is_some_and(|t| actual > t) {
                " (above it: the guest deflated rather than run out of memory)"
            } else {
                ""
            };
            r.problem(Some(format!(
                "ignores requests: asked for {} MiB, has {} MiB for {} s{why}; no entitlement reaches it, none is repaid from it",
                set.unwrap_or(0) >> 20,
                actual >> 20,
                since.elapsed().as_secs()
            )));
        }
        if let Some(p) = &stats_at {
            let (available, total) = q.balloon_guest_memory(p).unwrap_or((None, None));
            let short = short_of_memory(available, total);
            r.report(|s| {
                s.available = available;
                s.short = short;
            });
        }
        if wait_for_target(targets, Duration::from_secs(1), target).is_none() {
            return Ok(());
        }
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
mod tests {
    use super::*;

    #[test]
    fn a_guest_asks_by_its_environment_and_a_bad_value_is_named() {
        let env = |kvs: &[&str]| kvs.join("\0").into_bytes();
        assert_eq!(guest_asks(&env(&["PATH=/bin", "HOME=/"])), Ok((None, None)));
        assert_eq!(
            guest_asks(&env(&["MEMFOLD_CLAIM=never", "MEMFOLD_ALLOWANCE_MIB=128"])),
            Ok((Some(ClaimPolicy::Never), Some(128 << 20)))
        );
        let e = guest_asks(&env(&["MEMFOLD_CLAIM=all"])).unwrap_err();
        assert!(
            e.contains("expected never, allowance-only, at-once or under-pressure"),
            "{e}"
        );
        let e = guest_asks(&env(&["MEMFOLD_ALLOWANCE_MIB=lots"])).unwrap_err();
        assert!(e.contains("MEMFOLD_ALLOWANCE_MIB=\"lots\""), "{e}");
    }
}
