//! What each [`Op`] does to the guests, their agents, the wire and the engine.

use std::collections::VecDeque;

use memfold_core::backing::mem::MemGuestRam;
use memfold_core::backing::Clock;
use memfold_core::blobs::BlobHome;
use memfold_core::engine::Command;
use memfold_core::ids::{BaseBlock, DomainId, FillId, FrameId, Gfn};
use memfold_core::sim::{Event, Home, Shared, SimAgent};
use memfold_core::PAGE_SIZE;
use rand::{rngs::SmallRng, Rng, SeedableRng};

use super::free::guest_write;
use super::{
    fill_busy, flipped, new_engine, nonce_of, reads_right, Content, Harness, ModelVm, Op,
    PendingFill, DISK, MAX_VMS,
};

impl Harness {
    pub(super) fn apply(&mut self, op: &Op) -> Result<(), String> {
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
                    alone: self.setup.never_share_guests && self.next_pid % 3 == 0,
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
                    page_out_in_doubt: false,
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
            Op::GuestSample { vm, seed } => self.guest_sample(vm, seed),
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
                self.send_confirmed()?;
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
            Op::TouchHeld { vm, seed } => {
                if let Some(i) = self.pick(vm) {
                    let mut rng = SmallRng::seed_from_u64(seed);
                    let held = self.vms[i].held.iter().filter_map(|(c, _)| c.gfn());
                    let vm = i as u32;
                    for gfn in held.map(|g| g.0).collect::<Vec<_>>() {
                        // A write of no bytes still breaks a share or decodes.
                        let op = if rng.gen_bool(0.5) {
                            Op::Read { vm, gfn }
                        } else {
                            Op::WritePartial {
                                vm,
                                gfn,
                                offset: rng.gen(),
                                len: rng.gen(),
                                byte: rng.gen(),
                            }
                        };
                        self.apply(&op)?;
                    }
                }
            }
            Op::Report { vm } => {
                if let Some(i) = self.pick(vm).filter(|&i| self.vms[i].connected) {
                    // Events before the answers they followed: out of order, as only a
                    // misbehaving agent sends them.
                    let v = &mut self.vms[i];
                    v.page_out_in_doubt |= v.held.iter().any(|(c, _)| match *c {
                        Command::PageOut { gfn } => v.agent.events.contains(&Event::PagedIn(gfn)),
                        _ => false,
                    });
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
                let live: Vec<DomainId> = self.vms.iter().map(|v| self.domain_of(v)).collect();
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
                    assert!(self.engine.adopt_pool(
                        d,
                        self.engine_faults.backing(pool),
                        frames,
                        held
                    ));
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
                blobs.sort_by_key(|(_, st)| (st.home != BlobHome::Swap) == swap);
                if let Some(&(i, st)) = blobs.get((at % blobs.len().max(1) as u64) as usize) {
                    // The store or swap file this guest's agent holds (after a restart, an
                    // agent not yet re-attached still holds the old memfoldd's).
                    let shared = &self.vms[i].agent.shared;
                    let b = match st.home {
                        BlobHome::Swap => &shared.swap,
                        BlobHome::Store => &shared.store,
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
                let which = which as usize % 6;
                if let Some(f) = self.faults.get_mut(which) {
                    *f = on;
                }
                let agents = self.vms.iter().map(|v| &v.agent.shared);
                match which {
                    0 => self.pools.values().for_each(|p| p.file().fail_writes = on),
                    1 => agents.for_each(|s| s.store.file().fail_writes = on),
                    2 => agents.for_each(|s| s.swap.file().fail_writes = on),
                    3 => agents.for_each(|s| s.swap.file().fail_sync = on),
                    4 => self.engine_faults.fail_resize(on),
                    _ => self.engine_faults.fail_reads(on),
                }
            }
        }
        Ok(())
    }
}
