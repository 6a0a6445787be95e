//! The peer's proactive-reclaim controller, in the manner of Meta's Senpai, made safe as a
//! careful operator would run it: it must never get a guest killed.
//!
//! Every interval it reads the group ([`Reading`]) and decides one [`Action`]; the decision
//! is a pure function of the readings and the controller's own state ([`Controller`]), so
//! it is tested without a kernel. Between steps a watch ([`Controller::watch`], every
//! [`WATCH_SLICE`]) looks only at the group's OOM state and raises the limit at once when
//! a task waits for memory.
//!
//! - **cgroup v1**: the OOM killer is off for the group (`memory.oom_control` ← 1: a task
//!   at the limit with nothing left to reclaim waits, `under_oom` set, instead of being
//!   killed); the controller lowers `memory.limit_in_bytes` while pressure stays under the
//!   target and raises it over it, and the watch raises it by [`Senpai::max_backoff`] the
//!   moment `under_oom` shows, then probes no lower for [`Senpai::oom_cooldown_steps`].
//! - **cgroup v2**: `memory.max` stays unset (a hard max OOM-kills when reclaim fails);
//!   the controller writes `memory.reclaim` (N bytes, reclaimed in its thread, nothing
//!   killed if the kernel finds less) while the group's own pressure stays under the
//!   target and stops over it; OOM events in `memory.events` are counted and hold it.
//! - **Floors**, both versions: never under [`Senpai::min_limit`], never asking the group
//!   to give up more than the swap space it could go to (usage − free swap above the
//!   reserve), and not lowering at all while less than [`Senpai::swap_reserve`] of swap is
//!   free.

use std::time::Duration;

use memfold_sys::reclaim::{CgroupVersion, MemCgroup, OomState, ReclaimError, SwapSpace};
use serde::Serialize;

/// How often the watch reads the group's OOM state between steps.
pub const WATCH_SLICE: Duration = Duration::from_millis(100);

/// A limit at or above this, bytes, is "none" (v1 reads an unset limit as ~2^63, v2 as
/// `max`): nothing to back off from.
const UNLIMITED: u64 = 1 << 62;

/// Senpai's rule and the controller's safety settings.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Senpai {
    /// Pressure to hold, fraction (0.001 = 0.1%, Senpai's default).
    pub target: f64,
    /// Most the limit drops (v2: most is reclaimed) in one interval, fraction of usage
    /// (at zero pressure).
    pub max_probe: f64,
    /// Most the limit rises in one interval, fraction of the limit; also the rise at once
    /// when a task waits for memory (v1 `under_oom`).
    pub max_backoff: f64,
    /// How often the limit is set, s (Senpai's default: 6).
    pub interval_s: f64,
    /// The limit never goes under this (v2: reclaim never takes usage under it), bytes.
    pub min_limit: u64,
    /// Fraction of the host's swap space kept free: while less is free nothing more is
    /// reclaimed, and no step asks for more than what is free above it.
    pub swap_reserve: f64,
    /// Steps after an OOM episode or event during which the controller probes no lower.
    pub oom_cooldown_steps: u32,
}

impl Senpai {
    /// Senpai's limit rule alone (v1): under the target, `usage` less up to
    /// [`Senpai::max_probe`] of it, the closer to zero pressure the more; over the target,
    /// the limit raised by up to [`Senpai::max_backoff`], the further over the more. Never
    /// under [`Senpai::min_limit`]. Bytes.
    pub fn next(&self, limit: u64, usage: u64, pressure: f64) -> u64 {
        let next = if pressure < self.target {
            usage.min(limit) as f64 * (1.0 - self.probe(pressure))
        } else {
            let adj =
                ((pressure - self.target) / self.target * self.max_backoff).min(self.max_backoff);
            limit as f64 * (1.0 + adj)
        };
        (next.round() as u64).max(self.min_limit)
    }

    /// The fraction of usage one step gives up at `pressure` (under the target).
    fn probe(&self, pressure: f64) -> f64 {
        ((self.target - pressure) / self.target * self.max_probe).clamp(0.0, self.max_probe)
    }
}

/// What the controller reads for a step: all its input.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Reading {
    /// The group's usage, bytes.
    pub usage: u64,
    /// The group's hard limit now, bytes (≥ 2^62: none).
    pub limit: u64,
    /// Memory pressure over the last interval, fraction of time some task stalled (v1:
    /// the host's PSI; v2: the group's `memory.pressure`). Unused by the watch.
    pub pressure: f64,
    /// The group's OOM state.
    pub oom: OomState,
    /// The host's swap space.
    pub swap: SwapSpace,
}

/// Why the controller does nothing this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Hold {
    /// v2: pressure at or over the target (nothing is held back by a limit, so backing
    /// off is reclaiming nothing); v1 with no limit set yet.
    OverTarget,
    /// Less than [`Senpai::swap_reserve`] of swap is free.
    SwapNearlyFull,
    /// The floor is reached: usage cannot go lower without going under
    /// [`Senpai::min_limit`] or over the free swap.
    AtFloor,
    /// In the cooldown after an OOM episode or event.
    AfterOom,
}

/// One decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// v1: set `memory.limit_in_bytes` to this, bytes (lower: reclaim; higher: back off).
    SetLimit(u64),
    /// v2: reclaim this many bytes (`memory.reclaim`).
    Reclaim(u64),
    /// Nothing, and why.
    Hold(Hold),
}

/// What the controller did over a run: every step and every OOM sign it saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ControllerBook {
    /// Steps taken (one an interval).
    pub steps: u64,
    /// v1: limit writes that lowered it.
    pub lowered: u64,
    /// v1: limit writes that raised it on pressure over the target.
    pub raised: u64,
    /// v1: limit writes refused because the kernel could not reclaim that far (`EBUSY`) or
    /// cut short by the watch (`EINTR`).
    pub refused: u64,
    /// Writes (limit or `memory.reclaim`) the watch interrupted: still in the kernel after
    /// an interval, or in flight when a task waited for memory.
    pub interrupted: u64,
    /// v2: `memory.reclaim` writes, and those that got less than asked (`EAGAIN`).
    pub reclaims: u64,
    /// v2: of [`ControllerBook::reclaims`], those the kernel could not fully satisfy.
    pub reclaims_short: u64,
    /// v2: bytes asked of `memory.reclaim`, in all.
    pub reclaim_asked_bytes: u64,
    /// Steps held at the floor.
    pub held_at_floor: u64,
    /// Steps held with swap nearly full.
    pub held_swap_full: u64,
    /// v2: steps held over the target.
    pub held_over_target: u64,
    /// Steps held in the cooldown after an OOM sign.
    pub held_after_oom: u64,
    /// v1: episodes of `under_oom` (a task of the group waited for memory), each met by
    /// raising the limit at once.
    pub under_oom_episodes: u64,
    /// Limit raises by the watch (one or more an episode).
    pub rescues: u64,
    /// v2: new `oom` events of memory.events.
    pub oom_events: u64,
    /// New OOM kills in the group (`oom_kill`, both versions): must stay 0.
    pub oom_kills: u64,
    /// v1: the lowest limit set, bytes.
    pub lowest_limit: Option<u64>,
}

/// The controller: Senpai's rule, its safety, and its books. Pure: it reads nothing and
/// writes nothing itself ([`apply`] carries out its actions).
#[derive(Clone, Debug)]
pub struct Controller {
    /// Its settings.
    pub senpai: Senpai,
    /// The group's hierarchy: v1 sets the limit, v2 reclaims.
    pub version: CgroupVersion,
    /// What it did.
    pub book: ControllerBook,
    /// The OOM state last seen (counters are books since the group was made).
    last_oom: OomState,
    /// Steps left in the cooldown.
    cooldown: u32,
}

impl Controller {
    /// A controller for a group of `version` whose OOM state is `oom` now.
    pub fn new(senpai: Senpai, version: CgroupVersion, oom: OomState) -> Controller {
        Controller {
            senpai,
            version,
            book: ControllerBook::default(),
            last_oom: oom,
            cooldown: 0,
        }
    }

    /// The watch, between steps: books any new OOM sign and, on v1, answers a task waiting
    /// for memory (`under_oom`, or a kill) with the limit raised at once by
    /// [`Senpai::max_backoff`] over the larger of the limit and the usage. Any sign starts
    /// the cooldown. Reads only `r.oom`, `r.usage` and `r.limit`.
    pub fn watch(&mut self, r: &Reading) -> Option<Action> {
        let kills = r.oom.oom_kills.saturating_sub(self.last_oom.oom_kills);
        let events = r
            .oom
            .ooms
            .unwrap_or(0)
            .saturating_sub(self.last_oom.ooms.unwrap_or(0));
        let episode = r.oom.under_oom && !self.last_oom.under_oom;
        self.book.oom_kills += kills;
        self.book.oom_events += events;
        self.book.under_oom_episodes += u64::from(episode);
        self.last_oom = r.oom;
        if kills == 0 && events == 0 && !r.oom.under_oom {
            return None;
        }
        self.cooldown = self.senpai.oom_cooldown_steps;
        match self.version {
            CgroupVersion::V1 if r.limit < UNLIMITED => {
                self.book.rescues += 1;
                let base = r.limit.max(r.usage) as f64;
                Some(Action::SetLimit(
                    (base * (1.0 + self.senpai.max_backoff)).round() as u64,
                ))
            }
            _ => None,
        }
    }

    /// One step: the watch first (an OOM sign is answered before anything else), then
    /// Senpai's rule inside the floors (module docs).
    pub fn step(&mut self, r: &Reading) -> Action {
        self.book.steps += 1;
        if let Some(a) = self.watch(r) {
            return a;
        }
        let s = self.senpai;
        let over = r.pressure >= s.target;
        if over {
            // v1 backs off (raises the limit); v2 has no limit to raise: it stops reclaiming.
            if self.version == CgroupVersion::V1 && r.limit < UNLIMITED {
                self.book.raised += 1;
                return Action::SetLimit(s.next(r.limit, r.usage, r.pressure));
            }
            self.cooldown = self.cooldown.saturating_sub(1);
            self.book.held_over_target += 1;
            return Action::Hold(Hold::OverTarget);
        }
        if self.cooldown > 0 {
            self.cooldown -= 1;
            self.book.held_after_oom += 1;
            return Action::Hold(Hold::AfterOom);
        }
        let reserve = (r.swap.total as f64 * s.swap_reserve).round() as u64;
        let usable_swap = r.swap.free.saturating_sub(reserve);
        if usable_swap == 0 {
            self.book.held_swap_full += 1;
            return Action::Hold(Hold::SwapNearlyFull);
        }
        // What the group cannot give up: under the configured floor, or more than the swap
        // it could go to.
        let floor = s.min_limit.max(r.usage.saturating_sub(usable_swap));
        let from = r.usage.min(r.limit);
        let target = ((from as f64 * (1.0 - s.probe(r.pressure))).round() as u64).max(floor);
        if target >= from {
            self.book.held_at_floor += 1;
            return Action::Hold(Hold::AtFloor);
        }
        match self.version {
            CgroupVersion::V1 => {
                self.book.lowered += 1;
                self.book.lowest_limit =
                    Some(self.book.lowest_limit.map_or(target, |l| l.min(target)));
                Action::SetLimit(target)
            }
            CgroupVersion::V2 => {
                let bytes = from - target;
                self.book.reclaims += 1;
                self.book.reclaim_asked_bytes += bytes;
                Action::Reclaim(bytes)
            }
        }
    }

    /// Books the kernel's answer to an action carried out by [`apply`].
    pub fn answered(&mut self, action: Action, done: bool) {
        match action {
            Action::SetLimit(_) if !done => self.book.refused += 1,
            Action::Reclaim(_) if !done => self.book.reclaims_short += 1,
            _ => {}
        }
    }
}

/// Carries out `action` on `group`: returns whether the kernel did all of it (v1 limit
/// written, v2 all bytes reclaimed); a hold does nothing and returns true.
///
/// Errors: the file cannot be written for another reason (or `Reclaim` on v1).
pub fn apply(group: &MemCgroup, action: Action) -> Result<bool, ReclaimError> {
    match action {
        Action::SetLimit(bytes) => group.set_limit(bytes),
        Action::Reclaim(bytes) => group.reclaim(bytes),
        Action::Hold(_) => Ok(true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfold_sys::reclaim::MemCgroupRoot;

    const S: Senpai = Senpai {
        target: 0.001,
        max_probe: 0.02,
        max_backoff: 0.5,
        interval_s: 2.0,
        min_limit: 100,
        swap_reserve: 0.1,
        oom_cooldown_steps: 3,
    };

    /// Plenty of swap: 1 000 000 bytes, all free.
    const SWAP: SwapSpace = SwapSpace {
        total: 1_000_000,
        free: 1_000_000,
    };

    fn reading(usage: u64, limit: u64, pressure: f64) -> Reading {
        Reading {
            usage,
            limit,
            pressure,
            oom: OomState::default(),
            swap: SWAP,
        }
    }

    fn v1() -> Controller {
        Controller::new(S, CgroupVersion::V1, OomState::default())
    }

    fn v2() -> Controller {
        let oom = OomState {
            ooms: Some(0),
            ..OomState::default()
        };
        Controller::new(S, CgroupVersion::V2, oom)
    }

    #[test]
    fn senpais_rule_probes_down_under_the_target_and_backs_off_over_it() {
        // No pressure: the full probe off the usage.
        assert_eq!(S.next(10_000, 10_000, 0.0), 9_800);
        // Half the target: half the probe.
        assert_eq!(S.next(10_000, 10_000, 0.0005), 9_900);
        // A limit above usage (it never reached it): probed from usage.
        assert_eq!(S.next(50_000, 10_000, 0.0), 9_800);
        // Twice the target: the limit rises by the most it may.
        assert_eq!(S.next(10_000, 10_000, 0.002), 15_000);
        // 1.2× the target: a fifth of the most.
        assert_eq!(S.next(10_000, 10_000, 0.0012), 11_000);
        // Never under the floor.
        assert_eq!(S.next(101, 101, 0.0), 100);
    }

    #[test]
    fn v1_lowers_the_limit_under_the_target_and_raises_it_over() {
        let mut c = v1();
        // No limit yet: probed down from usage.
        assert_eq!(
            c.step(&reading(10_000, u64::MAX / 2, 0.0)),
            Action::SetLimit(9_800)
        );
        assert_eq!(c.step(&reading(9_800, 9_800, 0.0)), Action::SetLimit(9_604));
        // Over the target: raised.
        assert_eq!(
            c.step(&reading(9_604, 9_604, 0.002)),
            Action::SetLimit(14_406)
        );
        // Over the target with no limit set: nothing to raise.
        assert_eq!(
            c.step(&reading(10_000, u64::MAX, 0.01)),
            Action::Hold(Hold::OverTarget)
        );
        assert_eq!((c.book.lowered, c.book.raised, c.book.steps), (2, 1, 4));
        assert_eq!(c.book.lowest_limit, Some(9_604));
    }

    #[test]
    fn v1_under_oom_raises_the_limit_at_once_and_holds_after() {
        let mut c = v1();
        let mut r = reading(10_000, 10_000, 0.0);
        assert_eq!(c.watch(&r), None);
        r.oom.under_oom = true;
        r.oom.killer_off = true;
        // The watch answers at once, from the larger of limit and usage.
        assert_eq!(c.watch(&r), Some(Action::SetLimit(15_000)));
        // Still waiting at the next look: raised again, but one episode.
        r.limit = 15_000;
        assert_eq!(c.watch(&r), Some(Action::SetLimit(22_500)));
        assert_eq!(c.book.under_oom_episodes, 1);
        assert_eq!(c.book.rescues, 2);
        // Over: the next steps probe no lower, for the cooldown.
        r.oom.under_oom = false;
        r.limit = 22_500;
        for _ in 0..S.oom_cooldown_steps {
            assert_eq!(c.step(&r), Action::Hold(Hold::AfterOom));
        }
        assert_eq!(c.step(&r), Action::SetLimit(9_800));
        // A second episode is counted as one more.
        r.oom.under_oom = true;
        assert!(matches!(c.step(&r), Action::SetLimit(l) if l > r.limit));
        assert_eq!(c.book.under_oom_episodes, 2);
        assert_eq!(c.book.held_after_oom, 3);
        assert_eq!(c.book.oom_kills, 0);
    }

    #[test]
    fn v1_counts_a_kill_and_raises_the_limit() {
        let mut c = v1();
        let mut r = reading(10_000, 10_000, 0.0);
        r.oom.oom_kills = 1;
        assert_eq!(c.step(&r), Action::SetLimit(15_000));
        assert_eq!(c.book.oom_kills, 1);
        // Counted once: the counter is the kernel's since the group was made.
        r.limit = 15_000;
        assert_eq!(c.step(&r), Action::Hold(Hold::AfterOom));
        assert_eq!(c.book.oom_kills, 1);
    }

    #[test]
    fn the_floor_keeps_what_the_group_cannot_give_up() {
        for mut c in [v1(), v2()] {
            // Swap free just above the reserve (100 000): 100 bytes may go; the probe's 200
            // may not.
            let mut r = reading(10_000, 10_000, 0.0);
            r.swap.free = 100_100;
            let a = c.step(&r);
            match c.version {
                CgroupVersion::V1 => assert_eq!(a, Action::SetLimit(9_900)),
                CgroupVersion::V2 => assert_eq!(a, Action::Reclaim(100)),
            }
            // Swap at the reserve: nothing is lowered.
            r.swap.free = 100_000;
            assert_eq!(c.step(&r), Action::Hold(Hold::SwapNearlyFull));
            r.swap.free = 0;
            assert_eq!(c.step(&r), Action::Hold(Hold::SwapNearlyFull));
            // The configured floor.
            let r = reading(100, 100, 0.0);
            assert_eq!(c.step(&r), Action::Hold(Hold::AtFloor));
            let r = reading(50, 50, 0.0);
            assert_eq!(c.step(&r), Action::Hold(Hold::AtFloor));
            assert_eq!(c.book.held_swap_full, 2);
            assert_eq!(c.book.held_at_floor, 2);
        }
    }

    #[test]
    fn v2_reclaims_and_never_sets_a_limit() {
        let mut c = v2();
        // memory.max unset: reads as u64::MAX.
        let mut r = reading(10_000, u64::MAX, 0.0);
        assert_eq!(c.step(&r), Action::Reclaim(200));
        r.pressure = 0.0005;
        assert_eq!(c.step(&r), Action::Reclaim(100));
        // Over the target: it stops, it has nothing to raise.
        r.pressure = 0.01;
        assert_eq!(c.step(&r), Action::Hold(Hold::OverTarget));
        // An OOM event in memory.events: counted, no limit touched, cooldown.
        r.pressure = 0.0;
        r.oom.ooms = Some(2);
        assert_eq!(c.watch(&r), None);
        assert_eq!(c.book.oom_events, 2);
        assert_eq!(c.step(&r), Action::Hold(Hold::AfterOom));
        assert_eq!(c.book.reclaim_asked_bytes, 300);
        // Over a grid of readings, never a limit.
        let mut c = v2();
        for usage in [0, 100, 5_000, 1 << 30] {
            for limit in [0, usage, u64::MAX] {
                for pressure in [0.0, 0.0009, 0.001, 0.5] {
                    for under_oom in [false, true] {
                        let mut r = reading(usage, limit, pressure);
                        r.oom.under_oom = under_oom;
                        assert!(!matches!(c.step(&r), Action::SetLimit(_)), "{r:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn v1_never_reclaims_through_memory_reclaim() {
        let mut c = v1();
        for usage in [0, 100, 5_000, 1 << 30] {
            for limit in [usage, usage * 2, u64::MAX] {
                for pressure in [0.0, 0.0009, 0.001, 0.5] {
                    let r = reading(usage, limit, pressure);
                    assert!(!matches!(c.step(&r), Action::Reclaim(_)), "{r:?}");
                }
            }
        }
    }

    /// The environment variable that makes this test binary the child of
    /// [`a_v1_group_at_its_limit_waits_and_the_watch_frees_it`]: the group's cgroup.procs.
    const OOM_CHILD: &str = "MEMFOLD_OOM_WATCH_CHILD";

    /// The child's part: joins the group, then faults in 64 MiB of locked (unreclaimable)
    /// anonymous memory one page at a time, and exits 0 once it has it all.
    fn oom_child() {
        let Ok(procs) = std::env::var(OOM_CHILD) else {
            return;
        };
        std::fs::write(&procs, "0").unwrap();
        let len = 64usize << 20;
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: the mapping just made, of `len` bytes; pages are locked as they fault in.
        assert_eq!(unsafe { libc::mlock2(p, len, libc::MLOCK_ONFAULT) }, 0);
        for offset in (0..len).step_by(4096) {
            // SAFETY: inside the mapping; each write is a user fault charged to the group.
            unsafe { p.cast::<u8>().add(offset).write_volatile(1) };
        }
        std::process::exit(0);
    }

    /// On the host's real v1 hierarchy (root needed; skipped elsewhere): a task of a group
    /// with the OOM killer off that needs more than the limit and has nothing reclaimable
    /// (locked pages) waits with `under_oom` set; the controller's watch sees it and raises
    /// the limit until the task has what it needs; nothing is killed.
    #[test]
    fn a_v1_group_at_its_limit_waits_and_the_watch_frees_it() {
        oom_child();
        let root = match MemCgroupRoot::detect() {
            Ok(r) if r.version == CgroupVersion::V1 => r,
            other => {
                memfold_sys::testing::skipped(
                    "a_v1_group_at_its_limit_waits_and_the_watch_frees_it",
                    &format!("no v1 memory hierarchy here ({other:?})"),
                );
                return;
            }
        };
        let name = format!("memfold-oomwatch-test-{}", std::process::id());
        let g = match MemCgroup::create_in(&root, &name) {
            Ok(g) => g,
            Err(e) if rustix::process::geteuid().is_root() => {
                panic!("root cannot make a v1 memory cgroup: {e}")
            }
            Err(e) => {
                memfold_sys::testing::skipped(
                    "a_v1_group_at_its_limit_waits_and_the_watch_frees_it",
                    &format!("cannot make a memory cgroup (not root): {e}"),
                );
                return;
            }
        };
        assert!(g.disable_oom_killer().unwrap());
        assert!(g.set_limit(32 << 20).unwrap());
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "peer::controller::tests::a_v1_group_at_its_limit_waits_and_the_watch_frees_it",
                "--exact",
                "--nocapture",
            ])
            .env(OOM_CHILD, g.procs_file())
            .spawn()
            .unwrap();
        let mut c = Controller::new(S, CgroupVersion::V1, g.oom().unwrap());
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if std::time::Instant::now() > deadline {
                g.unlimit().unwrap();
                let _ = child.kill();
                let _ = child.wait();
                panic!("the child did not finish in 60 s: {:?}", c.book);
            }
            std::thread::sleep(WATCH_SLICE);
            let r = Reading {
                usage: g.usage().unwrap(),
                limit: g.limit().unwrap(),
                oom: g.oom().unwrap(),
                ..Reading::default()
            };
            if let Some(a) = c.watch(&r) {
                let done = apply(&g, a).unwrap();
                c.answered(a, done);
            }
        };
        assert!(status.success(), "{status}");
        let b = c.book;
        assert!(b.under_oom_episodes >= 1, "{b:?}");
        assert!(b.rescues >= 1, "{b:?}");
        assert_eq!(b.oom_kills, 0, "{b:?}");
        assert_eq!(g.oom().unwrap().oom_kills, 0);
        // 32 MiB, raised by half at each look while the child waited.
        assert!(g.limit().unwrap() >= 48 << 20);
        eprintln!("watch: {b:?}, limit now {} MiB", g.limit().unwrap() >> 20);
    }

    /// The actions land in the right file of a fake cgroupfs tree of each version.
    #[test]
    fn actions_write_the_versions_own_files() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("cgroup.procs"), "").unwrap();
        std::fs::write(t.path().join("cgroup.subtree_control"), "memory").unwrap();
        let v1_root = MemCgroupRoot::at(t.path(), CgroupVersion::V1);
        let g = MemCgroup::create_in(&v1_root, "v1").unwrap();
        std::fs::write(g.dir().join("memory.limit_in_bytes"), "9223372036854771712").unwrap();
        let mut c = v1();
        let a = c.step(&reading(10_000, u64::MAX / 2, 0.0));
        assert!(apply(&g, a).unwrap());
        let limit = std::fs::read_to_string(g.dir().join("memory.limit_in_bytes")).unwrap();
        assert_eq!(limit, "9800");
        assert!(!g.dir().join("memory.reclaim").exists());

        let v2_root = MemCgroupRoot::at(t.path(), CgroupVersion::V2);
        let g = MemCgroup::create_in(&v2_root, "v2").unwrap();
        std::fs::write(g.dir().join("memory.reclaim"), "").unwrap();
        std::fs::write(g.dir().join("memory.max"), "max").unwrap();
        let mut c = v2();
        let a = c.step(&reading(10_000, u64::MAX, 0.0));
        assert!(apply(&g, a).unwrap());
        assert_eq!(
            std::fs::read_to_string(g.dir().join("memory.reclaim")).unwrap(),
            "200"
        );
        assert_eq!(
            std::fs::read_to_string(g.dir().join("memory.max")).unwrap(),
            "max"
        );
        assert!(!g.dir().join("memory.limit_in_bytes").exists());
        // A hold writes nothing.
        assert!(apply(&g, Action::Hold(Hold::AtFloor)).unwrap());
    }
}
