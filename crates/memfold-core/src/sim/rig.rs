//! One engine over one in-memory guest and its agent ([`Rig`]), with the configuration and
//! guest report its tests use (split from sim/mod.rs, which passed 800 lines).

use super::{Event, Shared, SimAgent};
use crate::backing::mem::{ManualClock, MemBacking, MemGuestRam};
use crate::backing::Backing;
use crate::engine::{Attach, Command, Mapped};
use crate::ids::{DomainId, Gfn, VmId};
use crate::{Engine, EngineConfig, EngineError};

/// One engine over one in-memory guest and its agent, which carries out every command at
/// once and reports its events at once: what `memfold bench micro` and the criterion
/// benchmarks run (the reference model runs several guests over an unreliable wire).
pub struct Rig {
    /// The engine.
    pub engine: Engine,
    /// The guest's agent (guest accesses go through it).
    pub agent: SimAgent,
    /// The guest.
    pub vm: VmId,
    /// The engine's clock.
    pub clock: ManualClock,
}

/// A guest agent's report (PV §3.1) of a guest of `pages` pages, one run a page: every
/// page anonymous, inactive, unreferenced and in use; those in `never_share` marked never
/// to be shared (Satori §4.3).
pub fn anon_report(pages: u32, never_share: &[u32]) -> Vec<crate::categories::CategoryRun> {
    use crate::categories::{Category, CategoryRun, PageInfo};
    (0..pages)
        .map(|g| CategoryRun {
            first: Gfn(g),
            count: 1,
            info: PageInfo {
                category: Category::Anon,
                active: false,
                referenced: false,
                buddy: false,
                never_share: never_share.contains(&g),
            },
        })
        .collect()
}

/// A configuration for a [`Rig`] stepped 10 ms at a time: `policy`, no scan rate limit,
/// a full scan every 10 ms that reads every page, and the NRU clock every 100 ms.
pub fn quick_config(policy: crate::Policy) -> EngineConfig {
    EngineConfig {
        policy,
        rate: 0,
        clock_interval_us: Some(100_000),
        min_scan_interval_us: 10_000,
        max_scan_interval_us: 10_000,
        quiet_scan_period: 1,
        ..EngineConfig::default()
    }
}

/// The rig's guest as the engine attaches it (QEMU pid 1, domain 0).
fn rig_attach(
    ram: &MemGuestRam,
    pages: u32,
    shared: &Shared,
    mapped: Vec<(Gfn, Mapped)>,
    swap: Option<Box<dyn Backing>>,
) -> Attach {
    Attach {
        name: "rig".into(),
        pid: 1,
        pages,
        ram: Box::new(ram.clone()),
        mapped,
        domain: DomainId(0),
        store: Box::new(shared.store.clone()),
        swap,
        sharing: Default::default(),
    }
}

impl Rig {
    /// An engine with `cfg` and one guest of `pages` pages (no swap file).
    ///
    /// Errors: the configuration is invalid.
    pub fn new(cfg: EngineConfig, pages: u32) -> Result<Rig, EngineError> {
        Rig::with_swap(cfg, pages, 0)
    }

    /// As [`Rig::new`], the guest with a swap file of `swap_bytes` bytes (none if 0; the
    /// agent's `shared.swap`).
    ///
    /// Errors: the configuration is invalid.
    pub fn with_swap(cfg: EngineConfig, pages: u32, swap_bytes: u64) -> Result<Rig, EngineError> {
        let clock = ManualClock::new();
        let shared = Shared::default();
        let mut engine = Engine::new(cfg, Box::new(clock.clone()), swap_bytes)?;
        engine.add_domain(DomainId(0), Box::new(shared.pool.clone()));
        let ram = MemGuestRam::new(pages);
        let swap = (swap_bytes > 0).then(|| Box::new(shared.swap.clone()) as Box<dyn Backing>);
        let vm = engine.attach(rig_attach(&ram, pages, &shared, Vec::new(), swap))?;
        let agent = SimAgent::new(ram, pages, shared);
        Ok(Rig {
            engine,
            agent,
            vm,
            clock,
        })
    }

    /// The agent attaches again after its connection dropped (the caller detached the
    /// guest): with the list of what it maps, and a new store as memfoldd hands out at
    /// each attach (no swap file). Returns the guest's id.
    ///
    /// Errors: the agent's list, or the engine's refusal.
    pub fn reattach(&mut self) -> Result<VmId, String> {
        let mapped = self.agent.prepare_reattach()?;
        self.agent.shared.store = MemBacking::default();
        let a = rig_attach(
            &self.agent.ram,
            self.agent.pages(),
            &self.agent.shared,
            mapped,
            None,
        );
        self.engine.attach(a).map_err(|e| e.to_string())
    }

    /// The agent's events reach the engine.
    pub fn report(&mut self) {
        for e in std::mem::take(&mut self.agent.events) {
            match e {
                Event::CowBroken(g, f) => self.engine.cow_broken(self.vm, g, f),
                Event::Refilled(g) => self.engine.refilled(self.vm, g),
                Event::Unstashed(g) => self.engine.unstashed(self.vm, g),
                Event::Discarded(g, what) => self.engine.discarded(self.vm, g, what),
                Event::PagedIn(g) => self.engine.paged_in(self.vm, &[g]),
            }
        }
    }

    /// `us` µs of memfoldd in one step: the clock moves, the engine scans, runs the NRU
    /// clock and checks the host budget, and every command is carried out and answered (with the commands that
    /// answers lead to), then the agent reports.
    ///
    /// Errors: the engine's.
    pub fn step(&mut self, us: u64) -> Result<(), EngineError> {
        self.step_seeing(us, |_| {})
    }

    /// [`Rig::step`], with each command shown to `see` before the agent carries it out:
    /// a test's look at what memfoldd hands out (a stash's home, a move's checksum).
    ///
    /// Errors: the engine's.
    pub fn step_seeing(&mut self, us: u64, see: impl FnMut(&Command)) -> Result<(), EngineError> {
        self.clock.advance(us);
        self.engine.scan_step()?;
        self.engine.clock_step();
        self.engine.check_budget();
        self.carry_out_seeing(see);
        Ok(())
    }

    /// Every command queued is carried out and answered (with the commands that answers
    /// lead to), then the agent reports its events; no time passes.
    pub fn carry_out(&mut self) {
        self.carry_out_seeing(|_| {});
    }

    fn carry_out_seeing(&mut self, mut see: impl FnMut(&Command)) {
        loop {
            let cmds = self.engine.take_commands(self.vm);
            if cmds.is_empty() {
                break;
            }
            for c in cmds {
                see(&c);
                self.answer(c);
            }
        }
        self.report();
    }

    /// Command `c` carried out by the agent and its answer given to the engine: a clock
    /// scan's R and M bits, any other command's outcome.
    pub fn answer(&mut self, c: Command) {
        if let Some((first, n, r, m)) = self.agent.clock_scan_cmd(&c) {
            self.engine.clock_bits(self.vm, first, n, &r, &m);
        } else {
            let o = self.agent.execute(&c);
            self.engine.outcome(self.vm, &c, o);
        }
    }
}
