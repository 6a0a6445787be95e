//! A plain reference model of guest memory, and a harness that drives the engine memfoldd
//! runs — [`Engine`], over in-memory backings — with simulated agents ([`SimAgent`]) and
//! an unreliable wire: commands are delivered late, in part, refused, or lost with their
//! connection; agents re-attach; memfoldd restarts and adopts the pool. After every step
//! each guest page must read as the model says, the engine's invariants must hold, and
//! every frame or blob an agent relies on must still be held by the engine. The operations
//! and setups it draws from are in `ops.rs`, what each does in `apply.rs`, the checks in
//! `verify.rs`.

#![allow(dead_code)]

use std::cell::Cell;
use std::collections::VecDeque;

use std::collections::BTreeMap;

use memfold_core::backing::mem::{ManualClock, MemBacking};
use memfold_core::backing::Backing;
use memfold_core::categories::CategoryRun;
use memfold_core::engine::free_discard::WatchRound;
use memfold_core::engine::{Attach, Command, CompressBacking, Outcome, Sharing};
use memfold_core::ids::{DiskId, DomainId, FillId, FrameId, Gfn, VmId};
use memfold_core::sim::{Event, Home, Shared, SimAgent};
use memfold_core::{
    CompressCodec, Engine, EngineConfig, Page, PatchCodec, Policy, ZeroPolicy, PAGE_SIZE,
};
use rand::{rngs::SmallRng, Rng, SeedableRng};

mod agree;
mod alone;
mod apply;
mod backing;
mod confirm;
mod coverage;
mod free;
mod ops;
mod verify;
use backing::EngineFaults;
use free::guest_write;
pub use ops::*;

/// Most guests at once: enough for sharing across several, few enough to check every
/// page after every step.
const MAX_VMS: usize = 5;

/// Never-share guests' domains: this plus their pid (past the shared domains, 0..3).
const ALONE_DOMAINS: u32 = 1000;

struct ModelVm {
    /// The engine's id (a new engine gives new ids).
    id: Option<VmId>,
    pid: u32,
    /// A never-share guest ([`Setup::never_share_guests`]), in a domain of its own.
    alone: bool,
    agent: SimAgent,
    model: Vec<Box<Page>>,
    /// Commands sent and not answered.
    wire: VecDeque<Command>,
    /// Commands carried out whose answers the agent holds back: a misbehaving agent
    /// (a QEMU not to be trusted) may report the events that followed them first.
    held: Vec<(Command, Outcome)>,
    connected: bool,
    /// Fills its block device waits for, oldest first.
    fills: Vec<PendingFill>,
    /// Pages the guest freed (issue 17): their bytes are no one's until it writes them
    /// again, and may read as the old bytes or, discarded, as zeros (`may_zero`).
    free: Vec<bool>,
    /// Per page, whether a report that allowed discards reached memfoldd while it was
    /// free, since the guest last wrote it: only then may a free page read as zeros.
    may_zero: Vec<bool>,
    /// Its kernel poisons free pages (`page_poisoning`, `init_on_free`): its reports
    /// allow no discard, and a free page keeps its bytes (`Op::Poison`).
    poison: bool,
    /// A report of its free pages sampled and not yet applied (memfold-guest's answer in
    /// flight), with the watch round that was armed when it was asked for.
    sample: Option<(Vec<CategoryRun>, Option<WatchRound>)>,
    /// Pages the guest marks never to be shared (`memfold-guest never-share`), sent with
    /// its next sample.
    never: Vec<bool>,
    /// Per page, if the last report memfoldd applied (since it attached) marked it: the
    /// frames it may still be mapped onto until its take-back — the one it was on, or
    /// being shared onto, then. Any other frame is a share made after the mark.
    marked: Vec<Option<Vec<FrameId>>>,
    /// Bytes flipped in the store or swap file its agent holds now (`Op::Corrupt`): a
    /// page whose blob covers one may fail to decode (the guest "fails closed"), never
    /// read other bytes; any other page's error is a bug. A new store at the re-attach
    /// clears them.
    flips: Vec<(memfold_core::blobs::BlobHome, u64)>,
    /// A page-in it reported before its page-out's answer, since it attached: the engine
    /// may take it for an older page-out's whose answer was lost and book the page out
    /// while it is in RAM (`engine/early.rs`'s one exception, a lying agent's cost), until
    /// the agent attaches again.
    page_out_in_doubt: bool,
}

/// Whether page `g` of guest `v` is stashed in a blob that covers a byte `Op::Corrupt`
/// flipped: the one error the model excuses.
fn flipped(v: &ModelVm, g: Gfn) -> bool {
    let Home::Stashed(st) = v.agent.home(g) else {
        return false;
    };
    let end = st.offset + u64::from(st.len);
    v.flips
        .iter()
        .any(|&(home, at)| home == st.home && (st.offset..end).contains(&at))
}

/// In a page's `marked` list: a stash was under way at the mark, and may end with the
/// page unmapped onto a frame the model cannot see.
pub(crate) const ANY_FRAME: FrameId = FrameId(u32::MAX);

/// A read a block device asked to have filled from frames (Satori §5.2).
struct PendingFill {
    id: FillId,
    /// (page, its block).
    pages: Vec<(Gfn, u8)>,
}

/// Whether guest `v`'s page `g` may read `got`: the model's bytes, or — while a read into
/// it is in flight — the block that read brings (a fill made whose answer memfoldd did
/// not live to send: the buffer of a read under way holds old bytes or the read's).
fn reads_right(v: &ModelVm, g: Gfn, got: &Page) -> bool {
    *got == *v.model[g.index()]
        || v.free[g.index()] && v.may_zero[g.index()] && *got == [0u8; PAGE_SIZE]
        || v.fills
            .iter()
            .flat_map(|f| &f.pages)
            .any(|&(p, b)| p == g && *got == *base_block(b))
}

/// Whether a device read into page `g` is in flight. A guest does not touch such a page
/// (Linux keeps a page cache page locked under its read; an `O_DIRECT` buffer written
/// during its read is the program's own muddle), so the model's guest writes and
/// discards skip it: after one, the page may rightly hold the disk's bytes with the
/// guest's over them, which no model state names (run 7 of the long run found it).
fn fill_busy(v: &ModelVm, g: Gfn) -> bool {
    v.fills.iter().any(|f| f.pages.iter().any(|p| p.0 == g))
}

/// The one base image of the model's disks.
const DISK: DiskId = DiskId(1);

/// Base block `b` of the model's disk: what a read of it lands (the same in every guest).
fn base_block(b: u8) -> Box<Page> {
    Content::Base(b).render()
}

fn nonce_of(fill: FillId) -> [u64; 2] {
    [0x006e_6f6e_6365, fill.0]
}

pub struct Harness {
    engine: Engine,
    cfg: EngineConfig,
    setup: Setup,
    clock: ManualClock,
    /// Each domain's pool, as the agents of its guests hold it.
    pools: BTreeMap<DomainId, MemBacking>,
    /// Injected faults: pool writes, store writes, swap writes, swap syncs fail.
    faults: [bool; 4],
    /// Injected faults of the engine's own handles: growth and reads fail.
    engine_faults: EngineFaults,
    /// The engine's [pool errors, blob write errors] at the last check, and whether a
    /// fault that causes each was injected at some time since ([`Harness::no_errors`]).
    errors: Cell<([u64; 2], [bool; 2])>,
    vms: Vec<ModelVm>,
    next_pid: u32,
    pub steps: u64,
    next_fill: u64,
    /// Fills: [reads asked of the engine, pages it asked of agents, pages filled].
    pub fill_counts: [u64; 3],
    /// Agents' events that reached the engine while a request about their page was in
    /// flight ([`Harness::count_event`]).
    pub events_in_flight: u64,
    /// Attaches beside a never-share guest the engine refused ([`Harness::refused_beside`]).
    pub refused_beside: u64,
}

fn config(s: &Setup) -> EngineConfig {
    let policy = match s.policy % 4 {
        0 | 1 => Policy::difference_engine(),
        2 => Policy::sharing_only(),
        _ => Policy::aggressive(),
    };
    EngineConfig {
        policy,
        zero: [ZeroPolicy::Reclaim, ZeroPolicy::Share, ZeroPolicy::Keep][s.zero as usize % 3],
        patch_codec: PatchCodec::ALL[s.patch_codec as usize % PatchCodec::ALL.len()],
        // Cut-offs up to a page exercise the store's multi-page size classes.
        patch_cutoff: [2048, 4096][s.patch_codec as usize / PatchCodec::ALL.len() % 2],
        compress_codec: CompressCodec::ALL[s.compress_codec as usize % CompressCodec::ALL.len()],
        compress_cutoff: [2048, 3584, 4096]
            [s.compress_codec as usize / CompressCodec::ALL.len() % 3],
        rate: s.rate as u64,
        min_scan_interval_us: 100_000,
        max_scan_interval_us: 400_000,
        clock_interval_us: Some(300_000),
        host_budget: s.budget_pages.map(|p| p as u64 * PAGE_SIZE as u64),
        // Identical pages shared without a mapping (issue 19) in 3 setups of 4.
        share_cold_unmapped: (s.zero / 3) % 4 != 0,
        read_fill: true,
        // The clock's R from the guests' reports (issue 17) in half the setups: their LRU
        // pages armed for writes only.
        clock_from_guest: (s.policy / 4) % 2 == 1,
        // A wait target (issue 15) in half the setups: stores held back by the floor.
        wait_target_pct: ((s.policy / 8) % 2 == 1).then_some(3.0),
        // Pages that only compress go to the kernel's swap (issue 15) in half the setups.
        compress_backing: if (s.policy / 16) % 2 == 1 {
            CompressBacking::Zswap
        } else {
            CompressBacking::Store
        },
        // ...and with it, frames only patches hold every 0.3 s (issue 15), in 3 of 4.
        page_out_frames_us: ((s.policy / 32) % 4 != 0).then_some(300_000),
        // Quiet pages' hints in 3 hash intervals (DE §4.3's passes) in half the setups.
        share_passes: if s.policy / 128 == 1 { 3 } else { 1 },
        page_hash: if s.collide_hashes {
            colliding_hash
        } else {
            memfold_core::page_hash
        },
        ..EngineConfig::default()
    }
}

fn new_engine(cfg: &EngineConfig, setup: &Setup, clock: &ManualClock) -> Engine {
    Engine::new(
        cfg.clone(),
        Box::new(clock.clone()),
        setup.swap_pages as u64 * 4096,
    )
    .expect("valid config")
}

impl Harness {
    pub fn new(setup: &Setup) -> Harness {
        let cfg = config(setup);
        let clock = ManualClock::new();
        Harness {
            engine: new_engine(&cfg, setup, &clock),
            cfg,
            setup: setup.clone(),
            clock,
            pools: BTreeMap::new(),
            faults: [false; 4],
            engine_faults: EngineFaults::default(),
            errors: Cell::default(),
            vms: Vec::new(),
            next_pid: 100,
            steps: 0,
            next_fill: 0,
            fill_counts: [0; 3],
            events_in_flight: 0,
            refused_beside: 0,
        }
    }

    fn domain_of(&self, v: &ModelVm) -> DomainId {
        if v.alone {
            DomainId(ALONE_DOMAINS + v.pid)
        } else {
            DomainId(v.pid % self.setup.domains.max(1) as u32)
        }
    }

    /// A new backing with the faults injected now.
    fn backing(&self, write: usize) -> MemBacking {
        let b = MemBacking::new();
        b.file().fail_writes = self.faults[write];
        if write == 2 {
            b.file().fail_sync = self.faults[3];
        }
        b
    }

    /// What memfoldd hands a guest of domain `d` at attach: the domain's pool (created if
    /// the engine has no such domain), a new store and a new swap file of its own.
    fn hand_out(&mut self, d: DomainId) -> Shared {
        if !self.engine.has_domain(d) {
            let pool = self.backing(0);
            self.engine.add_domain(d, self.engine_faults.backing(&pool));
            self.pools.insert(d, pool);
        }
        Shared {
            pool: self.pools[&d].clone(),
            store: self.backing(1),
            swap: self.backing(2),
        }
    }

    /// Ends each domain's adoption once every guest of it is connected.
    fn end_adoptions(&mut self) {
        for &d in self.pools.keys() {
            let all = self
                .vms
                .iter()
                .filter(|v| self.domain_of(v) == d)
                .all(|v| v.connected);
            if all && self.engine.adoption_pending(d) {
                self.engine.end_adoption(d);
            }
        }
    }

    /// Pages on pool frames now, as (guest, gfn) that [`Op`]s name them by.
    pub fn on_frames(&self) -> Vec<(u32, u32)> {
        self.vms
            .iter()
            .enumerate()
            .flat_map(|(i, v)| {
                (0..v.agent.pages())
                    .filter(move |&g| matches!(v.agent.home(Gfn(g)), Home::Frame(_)))
                    .map(move |g| (i as u32, g))
            })
            .collect()
    }

    fn pick(&self, vm: u32) -> Option<usize> {
        (!self.vms.is_empty()).then(|| vm as usize % self.vms.len())
    }

    /// Guest `i`'s QEMU exits: its frame PTEs go with it, and memfoldd removes it.
    fn exit(&mut self, i: usize) {
        let mut v = self.vms.remove(i);
        v.agent.exit();
        if let Some(id) = v.id {
            self.engine.remove(id);
        }
    }

    fn attach(&mut self, i: usize) -> Result<(), String> {
        let v = &mut self.vms[i];
        let mapped = match v.agent.prepare_reattach() {
            Ok(m) => m,
            // A corrupted blob: this guest fails closed (its QEMU stops).
            Err(_) if (0..v.agent.pages()).any(|g| flipped(v, Gfn(g))) => {
                self.exit(i);
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        // A guest new to this engine: first, an attach beside a never-share guest fails.
        if self.vms[i].id.is_none() {
            self.refused_beside(i)?;
        }
        // A new store and swap file replace the old ones once the stashed pages are home.
        let d = self.domain_of(&self.vms[i]);
        let shared = self.hand_out(d);
        let with_swap = self.setup.budget_pages.is_some();
        let v = &mut self.vms[i];
        v.agent.shared = shared.clone();
        v.flips.clear();
        let id = self
            .engine
            .attach(Attach {
                name: format!("g{}", v.pid),
                pid: v.pid,
                pages: v.agent.pages(),
                ram: self.engine_faults.ram(&v.agent.ram),
                mapped,
                domain: d,
                store: self.engine_faults.backing(&shared.store),
                swap: with_swap.then(|| self.engine_faults.backing(&shared.swap)),
                sharing: if v.alone {
                    Sharing::NeverShare
                } else {
                    Sharing::Domain
                },
            })
            .map_err(|e| e.to_string())?;
        // A guest new to this engine (created, or after a restart) has no marks until its
        // next report; one re-attaching keeps the engine's (and the engine honours them).
        if v.id.is_none() {
            v.marked.iter_mut().for_each(|m| *m = None);
        }
        v.id = Some(id);
        v.connected = true;
        v.page_out_in_doubt = false;
        self.end_adoptions();
        Ok(())
    }

    /// Applies an outcome for VM `i`'s command.
    /// The answers guest `i`'s agent held back reach the engine, in order.
    fn answer_held(&mut self, i: usize) -> Result<(), String> {
        for (cmd, o) in std::mem::take(&mut self.vms[i].held) {
            self.answer(i, &cmd, o)?;
        }
        Ok(())
    }

    fn answer(&mut self, i: usize, cmd: &Command, o: Outcome) -> Result<(), String> {
        let id = self.vms[i].id.expect("connected VMs have an id");
        if let Command::ClockScan { .. } = cmd {
            if o == Outcome::Done {
                let (first, n, r, m) = self.vms[i].agent.clock_scan_cmd(cmd).expect("a scan");
                self.confirming(|e| e.clock_bits(id, first, n, &r, &m))?;
            }
            return Ok(());
        }
        self.engine.outcome(id, cmd, o);
        Ok(())
    }

    pub fn step(&mut self, op: &Op) -> Result<(), String> {
        self.note_faults();
        self.apply(op)?;
        self.note_faults();
        self.pump_fills()
    }

    /// What memfoldd does after a step for block devices: checks candidate blocks against
    /// the base (the model's base bytes) and hands each device its answers, which it
    /// completes: pages not filled it writes with the disk's bytes.
    fn pump_fills(&mut self) -> Result<(), String> {
        for c in self.engine.take_block_candidates() {
            let b = u8::try_from(c.block.block).map_err(|_| "a block never read")?;
            self.engine.block_verified(&c, &base_block(b));
        }
        for a in self.engine.take_fill_answers() {
            let Some(i) = self.vms.iter().position(|v| v.id == Some(a.vm)) else {
                continue;
            };
            let v = &mut self.vms[i];
            let Some(k) = v.fills.iter().position(|f| f.id == a.fill) else {
                // Given up on: the device has moved on.
                continue;
            };
            let f = v.fills.remove(k);
            self.fill_counts[2] += a.filled.len() as u64;
            for (g, b) in f.pages {
                let p = base_block(b);
                if !a.filled.contains(&g) {
                    match guest_write(v, g, 0, &p[..]) {
                        Ok(()) => {}
                        Err(_) if flipped(v, g) => continue,
                        Err(e) => return Err(e),
                    }
                }
                v.model[g.index()] = p;
            }
        }
        Ok(())
    }

    /// Every share that guest `i`'s `cmds` ask for — onto a mapped frame, or as a page
    /// identical to one (a share without a mapping) — names a frame that holds the page's
    /// bytes now: the engine confirmed them byte for byte (ESX §4.3), whatever the hashes
    /// said (a setup's hash collides on purpose). No guest op runs inside a step, so the
    /// bytes it confirmed are the bytes there.
    fn confirmed(&self, i: usize, cmds: &[Command]) -> Result<(), String> {
        let v = &self.vms[i];
        let pool = &self.pools[&self.domain_of(v)];
        for c in cmds {
            let (gfn, frame) = match *c {
                Command::Share { gfn, frame } => (gfn, frame),
                Command::Stash { gfn, stash, .. } if stash.len == 0 => match stash.reference {
                    Some(f) => (gfn, f),
                    None => continue,
                },
                _ => continue,
            };
            let mut held = [0u8; PAGE_SIZE];
            if pool.read(frame.offset(), &mut held).is_err() {
                return Err(format!("vm {i} {gfn}: {c:?} names {frame}, past its pool"));
            }
            if v.agent.peek(gfn).is_ok_and(|p| p[..] != held[..]) {
                return Err(format!(
                    "vm {i} {gfn}: {c:?}, but {frame} holds other bytes than the page"
                ));
            }
        }
        Ok(())
    }

    /// The connection of VM `i` drops: each command sent reached the agent or not.
    /// Guest `i`'s agent reports its events.
    fn report(&mut self, i: usize) {
        let id = self.vms[i].id.expect("connected");
        for e in std::mem::take(&mut self.vms[i].agent.events) {
            self.count_event(id, &e);
            match e {
                Event::CowBroken(g, f) => self.engine.cow_broken(id, g, f),
                Event::Refilled(g) => self.engine.refilled(id, g),
                Event::Unstashed(g) => self.engine.unstashed(id, g),
                Event::Discarded(g, what) => self.engine.discarded(id, g, what),
                Event::PagedIn(g) => self.engine.paged_in(id, &[g]),
            }
        }
    }

    /// Guest `i`'s oldest fill gives up: the device writes the disk's bytes, then the
    /// guest its own over each page.
    fn give_up(&mut self, i: usize) -> Result<(), String> {
        let v = &mut self.vms[i];
        if v.fills.is_empty() {
            return Ok(());
        }
        let f = v.fills.remove(0);
        for (g, b) in f.pages {
            let mut mine = base_block(b);
            mine[..8].copy_from_slice(&(0x6775_6573_7400 | f.id.0).to_le_bytes());
            for p in [base_block(b), mine.clone()] {
                match guest_write(v, g, 0, &p[..]) {
                    Ok(()) => v.model[g.index()] = p,
                    Err(_) if flipped(v, g) => break,
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    fn disconnect(&mut self, i: usize, seed: u64) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let id = self.vms[i].id.expect("connected");
        // Answers held back are lost with the connection, as are those not yet given.
        for (cmd, _) in std::mem::take(&mut self.vms[i].held) {
            self.engine.outcome(id, &cmd, Outcome::Lost);
        }
        for cmd in std::mem::take(&mut self.vms[i].wire) {
            if rng.gen_bool(0.5) {
                let v = &mut self.vms[i];
                if v.agent.clock_scan_cmd(&cmd).is_none() {
                    v.agent.execute(&cmd);
                }
            }
            self.engine.outcome(id, &cmd, Outcome::Lost);
        }
        self.engine.detach(id);
        self.vms[i].connected = false;
    }

    pub fn books(&self) -> memfold_core::engine::Books {
        self.engine.books()
    }

    /// The engine's reads and growths that failed, injected (`Op::Fail`).
    pub fn failed(&self) -> [u64; 2] {
        self.engine_faults.failed()
    }
}
