//! A plain reference model of guest memory, and a harness that drives the engine memfoldd
//! runs — [`Engine`], over in-memory backings — with simulated agents ([`SimAgent`]) and
//! an unreliable wire: commands are delivered late, in part, refused, or lost with their
//! connection; agents re-attach; memfoldd restarts and adopts the pool. After every step
//! each guest page must read as the model says, the engine's invariants must hold, and
//! every frame or blob an agent relies on must still be held by the engine. The operations
//! and setups it draws from are in `ops.rs`.

#![allow(dead_code)]

use std::collections::VecDeque;

use std::collections::BTreeMap;

use memfold_core::backing::mem::{ManualClock, MemBacking, MemGuestRam};
use memfold_core::backing::{Backing, Clock};
use memfold_core::categories::CategoryRun;
use memfold_core::engine::free_discard::WatchRound;
use memfold_core::engine::{Attach, Command, CompressBacking, Outcome};
use memfold_core::ids::{BaseBlock, DiskId, DomainId, FillId, FrameId, Gfn, VmId};
use memfold_core::p2m::PageState;
use memfold_core::sim::{Event, Home, Shared, SimAgent};
use memfold_core::{
    CompressCodec, Engine, EngineConfig, Page, PatchCodec, Policy, ZeroPolicy, PAGE_SIZE,
};
use rand::{rngs::SmallRng, Rng, SeedableRng};

mod agree;
mod confirm;
mod coverage;
mod free;
mod ops;
use free::guest_write;
pub use ops::*;

/// Most guests at once: enough for sharing across several, few enough to check every
/// page after every step.
const MAX_VMS: usize = 5;

struct ModelVm {
    /// The engine's id (a new engine gives new ids).
    id: Option<VmId>,
    pid: u32,
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
    vms: Vec<ModelVm>,
    next_pid: u32,
    pub steps: u64,
    next_fill: u64,
    /// Fills: [reads asked of the engine, pages it asked of agents, pages filled].
    pub fill_counts: [u64; 3],
    /// Agents' events that reached the engine while a request about their page was in
    /// flight ([`Harness::count_event`]).
    pub events_in_flight: u64,
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
            vms: Vec::new(),
            next_pid: 100,
            steps: 0,
            next_fill: 0,
            fill_counts: [0; 3],
            events_in_flight: 0,
        }
    }

    fn domain_of(&self, pid: u32) -> DomainId {
        DomainId(pid % self.setup.domains.max(1) as u32)
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
            self.engine.add_domain(d, Box::new(pool.clone()));
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
                .filter(|v| self.domain_of(v.pid) == d)
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
        // A new store and swap file replace the old ones once the stashed pages are home.
        let d = self.domain_of(self.vms[i].pid);
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
                ram: Box::new(v.agent.ram.clone()),
                mapped,
                domain: d,
                store: Box::new(shared.store),
                swap: with_swap.then(|| Box::new(shared.swap) as Box<dyn Backing>),
                sharing: Default::default(),
            })
            .map_err(|e| e.to_string())?;
        // A guest new to this engine (created, or after a restart) has no marks until its
        // next report; one re-attaching keeps the engine's (and the engine honours them).
        if v.id.is_none() {
            v.marked.iter_mut().for_each(|m| *m = None);
        }
        v.id = Some(id);
        v.connected = true;
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
        self.apply(op)?;
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

    fn apply(&mut self, op: &Op) -> Result<(), String> {
        self.steps += 1;
        match *op {
            Op::CreateVm { pages } => {
                if self.vms.len() >= MAX_VMS {
                    return Ok(());
                }
                let pages = pages.clamp(1, 64);
                let ram = MemGuestRam::new(pages);
                let mut agent = SimAgent::new(ram, pages, Shared::default());
                // The agent's VMA budget in half the setups: 2–9 pages on frames, so that
                // shares are refused and mapped shares are unmapped under pressure.
                agent.frame_budget = (self.setup.patch_codec / 8 % 2 == 0)
                    .then_some(2 + (self.setup.compress_codec as usize / 8) % 8);
                self.next_pid += 1;
                self.vms.push(ModelVm {
                    id: None,
                    pid: self.next_pid,
                    agent,
                    model: (0..pages).map(|_| Box::new([0u8; PAGE_SIZE])).collect(),
                    wire: VecDeque::new(),
                    held: Vec::new(),
                    connected: false,
                    fills: Vec::new(),
                    free: vec![false; pages as usize],
                    may_zero: vec![false; pages as usize],
                    poison: false,
                    sample: None,
                    never: vec![false; pages as usize],
                    marked: vec![None; pages as usize],
                    flips: Vec::new(),
                });
                self.attach(self.vms.len() - 1)?;
            }
            Op::DestroyVm { vm } => {
                if let Some(i) = self.pick(vm) {
                    self.exit(i);
                    self.end_adoptions();
                }
            }
            Op::WritePage { vm, gfn, content } => {
                if let Some(i) = self.pick(vm) {
                    let v = &mut self.vms[i];
                    let g = gfn % v.agent.pages();
                    if fill_busy(v, Gfn(g)) {
                        return Ok(());
                    }
                    let p = content.render();
                    match guest_write(v, Gfn(g), 0, &p[..]) {
                        Ok(()) => v.model[g as usize] = p,
                        Err(_) if flipped(v, Gfn(g)) => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            Op::ReadLanded { vm, gfn, n, block } => {
                if let Some(i) = self.pick(vm) {
                    let v = &mut self.vms[i];
                    let pages = v.agent.pages();
                    let mut landed = Vec::new();
                    for k in 0..n as u32 {
                        let g = (gfn % pages + k) % pages;
                        if fill_busy(v, Gfn(g)) {
                            continue;
                        }
                        // One read in three: the guest overwrote its first page with its
                        // own bytes before memfoldd looked (the same bytes in every guest
                        // that does, so they share): that block must never be taken as
                        // held.
                        let forged = gfn % 3 == 0 && k == 0;
                        let p = if forged {
                            Content::Similar(block, 77).render()
                        } else {
                            Content::Base(block.wrapping_add(k as u8)).render()
                        };
                        match guest_write(v, Gfn(g), 0, &p[..]) {
                            Ok(()) => {
                                v.model[g as usize] = p;
                                landed.push(Gfn(g));
                            }
                            Err(_) if flipped(v, Gfn(g)) => {}
                            Err(e) => return Err(e),
                        }
                    }
                    if let Some(id) = v.id {
                        // Named by base block too: the engine may learn which frame holds
                        // it (from the base's bytes, `pump_fills`).
                        let from_base: Vec<(Gfn, BaseBlock)> = landed
                            .iter()
                            .map(|&g| {
                                let k = (g.0 + pages - gfn % pages) % pages;
                                let block = block.wrapping_add(k as u8) as u64;
                                (g, BaseBlock { disk: DISK, block })
                            })
                            .collect();
                        self.confirming(|e| {
                            e.read_landed(id, &landed, 0);
                            e.landed_from_base(id, &from_base);
                        })?;
                    }
                }
            }
            Op::FillRead { vm, gfn, n, block } => {
                if let Some(i) = self.pick(vm) {
                    self.next_fill += 1;
                    let id = FillId(self.next_fill);
                    let nonce = nonce_of(id);
                    let head = [nonce[0].to_ne_bytes(), nonce[1].to_ne_bytes()].concat();
                    let v = &mut self.vms[i];
                    let pages = v.agent.pages();
                    let mut asked = Vec::new();
                    for k in 0..n as u32 {
                        let g = Gfn((gfn % pages + k) % pages);
                        // Two reads into one buffer at once: a guest's own muddle.
                        if fill_busy(v, g) || asked.iter().any(|&(a, _)| a == g) {
                            continue;
                        }
                        match guest_write(v, g, 0, &head) {
                            Ok(()) => v.model[g.index()][..16].copy_from_slice(&head),
                            Err(_) if flipped(v, g) => continue,
                            Err(e) => return Err(e),
                        }
                        asked.push((g, block.wrapping_add(k as u8)));
                    }
                    let blocks: Vec<(Gfn, BaseBlock)> = asked
                        .iter()
                        .map(|&(g, b)| {
                            (
                                g,
                                BaseBlock {
                                    disk: DISK,
                                    block: b as u64,
                                },
                            )
                        })
                        .collect();
                    v.fills.push(PendingFill { id, pages: asked });
                    match v.id.filter(|_| v.connected) {
                        Some(vid) => {
                            // The nonce's CoW breaks (a freed page still shared) reach
                            // memfoldd before the device's request, or after.
                            if gfn % 2 == 0 {
                                self.report(i);
                            }
                            let asked = self.engine.fill_read(vid, id, &blocks, nonce);
                            self.fill_counts[0] += 1;
                            self.fill_counts[1] += asked as u64;
                        }
                        // No memfoldd to ask: the device times out.
                        None => self.give_up(i)?,
                    }
                }
            }
            Op::FillGiveUp { vm } => {
                if let Some(i) = self.pick(vm) {
                    self.give_up(i)?;
                }
            }
            Op::WritePartial {
                vm,
                gfn,
                offset,
                len,
                byte,
            } => {
                if let Some(i) = self.pick(vm) {
                    let v = &mut self.vms[i];
                    let g = gfn % v.agent.pages();
                    let off = offset as usize % PAGE_SIZE;
                    let len = (len as usize % 64).min(PAGE_SIZE - off);
                    if fill_busy(v, Gfn(g)) {
                        return Ok(());
                    }
                    let bytes = vec![byte; len];
                    match guest_write(v, Gfn(g), off, &bytes) {
                        Ok(()) => v.model[g as usize][off..off + len].copy_from_slice(&bytes),
                        Err(_) if flipped(v, Gfn(g)) => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            Op::Discard { vm, gfn, n } => {
                if let Some(i) = self.pick(vm) {
                    let v = &mut self.vms[i];
                    let pages = v.agent.pages();
                    for k in 0..n as u32 {
                        let g = (gfn % pages + k).min(pages - 1);
                        if fill_busy(v, Gfn(g)) {
                            continue;
                        }
                        v.agent.discard(Gfn(g));
                        *v.model[g as usize] = [0u8; PAGE_SIZE];
                    }
                }
            }
            Op::Free { vm, gfn, n } => self.free(vm, gfn, n),
            Op::Mark { vm, gfn, n, on } => self.mark(vm, gfn, n, on),
            Op::GuestSample { vm } => self.guest_sample(vm),
            Op::GuestReport { vm } => self.guest_report(vm),
            Op::Poison { vm } => self.poison(vm),
            Op::Waited { vm, pct } => {
                if let Some(v) = self.pick(vm).map(|i| &self.vms[i]) {
                    if let Some(id) = v.id.filter(|_| v.connected) {
                        let waited = self.clock.now_us() * pct as u64 / 100;
                        self.engine.guest_waited(id, waited);
                    }
                }
            }
            Op::Read { vm, gfn } => {
                if let Some(i) = self.pick(vm) {
                    let v = &mut self.vms[i];
                    let g = gfn % v.agent.pages();
                    let got = match v.agent.read(Gfn(g)) {
                        Ok(got) => got,
                        Err(_) if flipped(v, Gfn(g)) => return Ok(()),
                        Err(e) => return Err(e),
                    };
                    if !reads_right(v, Gfn(g), &got) {
                        return Err(format!(
                            "vm {i} gfn {g}: the guest read bytes it did not write"
                        ));
                    }
                }
            }
            Op::Step { advance_ms } => {
                // What other ops queued goes out first: what follows is this step's alone.
                for v in self.vms.iter_mut().filter(|v| v.connected) {
                    let cmds = self.engine.take_commands(v.id.expect("connected"));
                    v.wire.extend(cmds);
                }
                self.clock.advance(advance_ms as u64 * 1000);
                self.engine.scan_step().map_err(|e| e.to_string())?;
                self.engine.clock_step();
                self.engine.check_budget();
                for i in 0..self.vms.len() {
                    if !self.vms[i].connected {
                        continue;
                    }
                    let cmds = self
                        .engine
                        .take_commands(self.vms[i].id.expect("connected"));
                    self.confirmed(i, &cmds)?;
                    self.vms[i].wire.extend(cmds);
                }
            }
            Op::Deliver {
                vm,
                n,
                refuse,
                hold,
            } => {
                if let Some(i) = self.pick(vm).filter(|&i| self.vms[i].connected) {
                    self.answer_held(i)?;
                    self.vms[i].agent.refuse = refuse;
                    for _ in 0..n {
                        let Some(cmd) = self.vms[i].wire.pop_front() else {
                            break;
                        };
                        let o = self.vms[i].agent.execute(&cmd);
                        if hold {
                            self.vms[i].held.push((cmd, o));
                        } else {
                            self.answer(i, &cmd, o)?;
                        }
                    }
                    self.vms[i].agent.refuse = false;
                }
            }
            Op::Report { vm } => {
                if let Some(i) = self.pick(vm).filter(|&i| self.vms[i].connected) {
                    // Events before the answers they followed: out of order, as only a
                    // misbehaving agent sends them.
                    self.report(i);
                    self.answer_held(i)?;
                }
            }
            Op::Disconnect { vm, seed } => {
                if let Some(i) = self.pick(vm).filter(|&i| self.vms[i].connected) {
                    self.disconnect(i, seed);
                }
            }
            Op::OptOut { vm, out } => {
                if let Some(id) = self.pick(vm).and_then(|i| self.vms[i].id) {
                    if out {
                        self.engine.opt_out(id);
                    } else {
                        self.engine.opt_in(id);
                    }
                }
            }
            Op::Reattach { vm } => {
                if let Some(i) = self.pick(vm).filter(|&i| !self.vms[i].connected) {
                    self.attach(i)?;
                }
            }
            Op::Restart { seed } => {
                // The old memfoldd's guest channels end with it, and their answers.
                for v in &mut self.vms {
                    v.sample = None;
                }
                for i in 0..self.vms.len() {
                    if self.vms[i].connected {
                        self.disconnect(i, seed.wrapping_add(i as u64));
                    }
                }
                // The old memfoldd's stores and swap files live on in the agents that hold
                // them; the new one hands out its own and adopts each domain's pool.
                self.engine = new_engine(&self.cfg, &self.setup, &self.clock);
                let live: Vec<DomainId> = self.vms.iter().map(|v| self.domain_of(v.pid)).collect();
                self.pools.retain(|d, _| live.contains(d));
                for (&d, pool) in &self.pools {
                    let (frames, held): (u32, Vec<FrameId>) = {
                        let f = pool.file();
                        let frames = (f.bytes.len() / PAGE_SIZE) as u32;
                        (
                            frames,
                            f.allocated.iter().map(|&p| FrameId(p as u32)).collect(),
                        )
                    };
                    assert!(self
                        .engine
                        .adopt_pool(d, Box::new(pool.clone()), frames, held));
                }
                for v in &mut self.vms {
                    v.id = None;
                }
            }
            Op::Corrupt { swap, at, bit } => {
                // A bit of a stored page's blob, as a QEMU holding the store could flip it
                // (`swap` picks among the blobs in the swap file first).
                let mut blobs: Vec<(usize, _)> = self
                    .vms
                    .iter()
                    .enumerate()
                    .flat_map(|(i, v)| (0..v.agent.pages()).map(move |g| (i, v.agent.home(Gfn(g)))))
                    .filter_map(|(i, h)| match h {
                        // An empty blob (identical to its frame) has no byte to flip.
                        Home::Stashed(st) if st.len > 0 => Some((i, st)),
                        _ => None,
                    })
                    .collect();
                blobs.sort_by_key(|(_, st)| {
                    (st.home != memfold_core::blobs::BlobHome::Swap) == swap
                });
                if let Some(&(i, st)) = blobs.get((at % blobs.len().max(1) as u64) as usize) {
                    // The store or swap file this guest's agent holds (after a restart, an
                    // agent not yet re-attached still holds the old memfoldd's).
                    let shared = &self.vms[i].agent.shared;
                    let b = match st.home {
                        memfold_core::blobs::BlobHome::Swap => &shared.swap,
                        memfold_core::blobs::BlobHome::Store => &shared.store,
                    };
                    let mut f = b.file();
                    let at = (st.offset + at % st.len as u64) as usize;
                    if at < f.bytes.len() {
                        f.bytes[at] ^= 1 << bit;
                        drop(f);
                        self.vms[i].flips.push((st.home, at as u64));
                    }
                }
            }
            Op::Fail { which, on } => {
                let which = which as usize % 4;
                self.faults[which] = on;
                let agents = self.vms.iter().map(|v| &v.agent.shared);
                match which {
                    0 => self.pools.values().for_each(|p| p.file().fail_writes = on),
                    1 => agents.for_each(|s| s.store.file().fail_writes = on),
                    2 => agents.for_each(|s| s.swap.file().fail_writes = on),
                    _ => agents.for_each(|s| s.swap.file().fail_sync = on),
                }
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
        let pool = &self.pools[&self.domain_of(v.pid)];
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

    /// Every page reads as the model says; the engine's invariants hold; every frame and
    /// blob an agent relies on is held by the engine.
    pub fn verify_all(&self) -> Result<(), String> {
        self.engine.check_invariants()?;
        // No leak: each pool, store and swap file holds exactly what the books hold.
        let held = self.engine.books().held;
        for (what, (h, b)) in ["pools", "stores", "swap files"].iter().zip(held) {
            if h != b {
                return Err(format!("the {what} hold {h} bytes, the books {b}"));
            }
        }
        // The pool counts exactly the live QEMUs' present PTEs onto its frames (what
        // `MADV_PAGEOUT` reads; an exited QEMU's went with it).
        for (d, pool) in &self.pools {
            let counted: u64 = pool.file().mapped.values().map(|&n| u64::from(n)).sum();
            let ptes: u64 = (self.vms.iter())
                .filter(|v| self.domain_of(v.pid) == *d)
                .map(|v| v.agent.frame_ptes())
                .sum();
            if counted != ptes {
                return Err(format!(
                    "the pool of {d} counts {counted} mapped pages, its guests map {ptes}"
                ));
            }
        }
        for (i, v) in self.vms.iter().enumerate() {
            for g in 0..v.agent.pages() {
                let g = Gfn(g);
                match v.agent.peek(g) {
                    Ok(got) if !reads_right(v, g, &got) => {
                        return Err(format!(
                            "vm {i} {g} ({:?}): reads bytes the guest did not write",
                            v.agent.home(g)
                        ));
                    }
                    Ok(_) => {}
                    // Its blob corrupted: it fails closed. Its books are checked still.
                    Err(_) if flipped(v, g) => {}
                    Err(e) => return Err(format!("vm {i} {g}: {e}")),
                }
                match v.agent.home(g) {
                    Home::Frame(f) => {
                        if !self.engine.frame_held(self.domain_of(v.pid), f) {
                            return Err(format!("vm {i} {g} maps {f}, which the engine freed"));
                        }
                        if let Some(allowed) = v.marked[g.index()].as_ref().filter(|_| v.connected)
                        {
                            // Never-share (Satori §4.3): no share after the mark.
                            if !allowed.contains(&f) {
                                return Err(format!(
                                    "vm {i} {g}: marked never-share, yet mapped onto {f} (before the mark: {allowed:?})"
                                ));
                            }
                        }
                        if let Some(id) = v.id.filter(|_| v.connected) {
                            let s = self.engine.page_state(id, g);
                            if !matches!(s, Some(PageState::Shared(x) | PageState::Sharing(x)) if x == f)
                            {
                                return Err(format!("vm {i} {g} maps {f}, the engine says {s:?}"));
                            }
                        }
                    }
                    Home::Stashed(st) => {
                        // A patch's reference page is held while the patch is.
                        if let Some(f) = st.reference {
                            if !self.engine.frame_held(self.domain_of(v.pid), f) {
                                return Err(format!(
                                    "vm {i} {g} is a patch against {f}, which the engine freed"
                                ));
                            }
                        }
                        if let Some(id) = v.id.filter(|_| v.connected) {
                            let s = self.engine.page_state(id, g);
                            if let Some(PageState::Unmapped(f)) = s {
                                // Shared without a mapping: the agent holds the empty
                                // patch against that very frame, nothing else.
                                if st.reference != Some(f) || st.len != 0 {
                                    return Err(format!(
                                        "vm {i} {g} is unmapped onto {f}, but the agent holds {st:?}"
                                    ));
                                }
                                // Never-share: no unmapped share made after the mark.
                                let marked = v.marked[g.index()].as_ref().filter(|_| v.connected);
                                if marked
                                    .is_some_and(|a| !a.contains(&f) && !a.contains(&ANY_FRAME))
                                {
                                    return Err(format!(
                                        "vm {i} {g}: marked never-share, yet unmapped onto {f}"
                                    ));
                                }
                            } else if !matches!(
                                s,
                                Some(
                                    PageState::Stored(_)
                                        | PageState::Stashing(_)
                                        | PageState::Moving(_)
                                )
                            ) {
                                return Err(format!(
                                    "vm {i} {g} is stashed, the engine says {s:?}"
                                ));
                            }
                        }
                    }
                    Home::Zero | Home::Private => {}
                }
            }
        }
        Ok(())
    }

    /// Drains every wire, re-attaches everyone, removes every guest: nothing may remain.
    pub fn teardown(mut self) -> Result<(), String> {
        let mut i = 0;
        while i < self.vms.len() {
            if !self.vms[i].connected {
                let n = self.vms.len();
                self.attach(i)?;
                if self.vms.len() < n {
                    continue; // failed closed and removed
                }
            }
            self.answer_held(i)?;
            while let Some(cmd) = self.vms[i].wire.pop_front() {
                let o = self.vms[i].agent.execute(&cmd);
                self.answer(i, &cmd, o)?;
            }
            self.report(i);
            i += 1;
        }
        self.verify_all()?;
        for (i, v) in self.vms.iter().enumerate() {
            self.books_agree_with_agent(i, v)?;
        }
        for mut v in std::mem::take(&mut self.vms) {
            v.agent.exit();
            self.engine.remove(v.id.expect("attached"));
        }
        for &d in self.pools.keys() {
            self.engine.end_adoption(d);
        }
        self.engine.check_invariants()?;
        let b = self.engine.books();
        if b.frames != 0 || b.store_pages != 0 || b.swap.file_pages != 0 || b.domains != 0 {
            return Err(format!("leak after teardown: {b:?}"));
        }
        for (d, pool) in &self.pools {
            let mapped = pool.file().mapped.len();
            if mapped != 0 {
                return Err(format!(
                    "{mapped} frames of the pool of {d} still mapped after every QEMU exited"
                ));
            }
            if pool.allocated_bytes() != 0 {
                return Err(format!(
                    "{} bytes of the pool of {d} still allocated after teardown",
                    pool.allocated_bytes()
                ));
            }
        }
        Ok(())
    }

    pub fn books(&self) -> memfold_core::engine::Books {
        self.engine.books()
    }
}
