//! Block devices (`memfold-blk`, Satori §4.1, §5.2): their reports of pages disk reads
//! filled, their requests to have reads served from frames, and what memfoldd tells
//! them back.
//!
//! Trust: a device is an operator's process (its hello is heard from root or memfoldd's
//! own user only, `readers.rs`), but its peer QEMU is not, so nothing a device says about
//! a page's content is believed:
//! - a base image is named by the descriptor the device passes in its hello, checked
//!   against the id it claims (`fstat`), and only bases so checked are taken;
//! - which frame holds a base block is learnt from the base's own bytes, read here
//!   through that descriptor, never from a guest page ([`memfold_core::engine::fill`]);
//! - a fill maps a frame over a page only where the agent finds the device's nonce
//!   under write-protection, so a device that gave up waiting loses nothing.
//!
//! A device sees only answers to its own requests, for pages of the guest whose RAM it
//! names; which base blocks frames hold it is told for its own bases only, and only of
//! its guest's sharing domain: a block held by another tenant's frames must not make
//! this guest's reads of it slower or faster (a fill is refused across domains anyway,
//! but the device would ask, and the time it takes would tell).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;

use memfold_core::engine::fill::MAX_WAITING;
use memfold_core::engine::BlockCandidate;
use memfold_core::ids::{BaseBlock, DiskId, DomainId, FillId, Gfn, VmId};
use memfold_core::{Engine, Page, PAGE_SIZE};
use memfold_wire::{Conn, ToDaemon, ToDevice, MAX_BATCH};

use super::guests::Guests;

/// Base blocks read to check candidates per main-loop step at most (each one disk read,
/// ~10–100 µs); the rest wait for the next step.
const MAX_CHECKS_PER_STEP: usize = 256;

/// A page, aligned for `O_DIRECT` reads (the device's base descriptor is `O_DIRECT`).
#[repr(C, align(4096))]
struct AlignedPage([u8; PAGE_SIZE]);

struct Device {
    conn: Conn,
    bases: HashMap<DiskId, File>,
    /// The guest whose RAM its reports and fills name (the last one named); none until
    /// its first: no news of held blocks until then, and none of blocks learnt before
    /// (each was checked against the base's bytes when learnt; a base changed in place
    /// since — same file, new bytes, which a device opened after the change cannot
    /// tell — would have this device's reads filled with the old ones).
    vm: Option<VmId>,
}

impl Device {
    /// Sends `m`; false if it failed. A device gone, or not reading for the send timeout,
    /// is closed (its reader sees the end), so that the next send fails at once instead
    /// of stalling memfoldd again.
    fn send(&self, m: &ToDevice) -> bool {
        let sent = self.conn.send(m, &[]).is_ok();
        if !sent {
            self.conn.shutdown();
        }
        sent
    }

    /// Tells the device that frames hold `blocks` (of its bases).
    fn tell_held(&self, blocks: &[BaseBlock]) {
        for chunk in blocks.chunks(MAX_BATCH) {
            let held = ToDevice::Held {
                blocks: chunk.to_vec(),
            };
            if !self.send(&held) {
                return;
            }
        }
    }
}

/// The block devices attached, by connection.
#[derive(Default)]
pub(crate) struct Devices {
    by_token: BTreeMap<u64, Device>,
    /// Fills under way: memfoldd's id → (connection, the device's id).
    fills: HashMap<FillId, (u64, FillId)>,
    next_fill: u64,
    /// Candidates waiting to be checked against their base, oldest first: at most
    /// [`MAX_WAITING`], as in the engine (shares at read faster than
    /// [`MAX_CHECKS_PER_STEP`] a step, sustained, grew it without bound).
    unchecked: VecDeque<BlockCandidate>,
    /// Candidates dropped with [`MAX_WAITING`] waiting (cumulative): their blocks are
    /// not learnt as held, nothing else.
    pub(crate) unchecked_dropped: u64,
    /// Pages filled from frames, all devices (cumulative).
    pub(crate) filled: u64,
    /// Fill requests answered, all devices (cumulative).
    pub(crate) fills_answered: u64,
    /// Base blocks read to check what a frame holds (cumulative).
    pub(crate) blocks_checked: u64,
}

impl Devices {
    /// Device connection `token` said hello, serving the checked `bases`.
    pub(crate) fn hello(&mut self, token: u64, conn: Conn, bases: Vec<(DiskId, File)>) {
        self.by_token.insert(
            token,
            Device {
                conn,
                bases: bases.into_iter().collect(),
                vm: None,
            },
        );
    }

    /// Device connection `token` ended.
    pub(crate) fn gone(&mut self, token: u64) {
        self.by_token.remove(&token);
        self.fills.retain(|_, (t, _)| *t != token);
    }

    /// A message of device `token`: a report (looked up now, Satori §4.1) or a fill
    /// (Satori §5.2). A message naming no attached guest's RAM, too many pages, or a base
    /// the device did not show, is dropped with a count (a fill is answered empty).
    pub(crate) fn message(
        &mut self,
        engine: &mut Engine,
        guests: &mut Guests,
        token: u64,
        msg: ToDaemon,
    ) {
        let vm = match &msg {
            ToDaemon::ReadLanded { ram, .. } | ToDaemon::FillRead { ram, .. } => {
                guests.vm_of_ram((ram.dev, ram.ino))
            }
            _ => None,
        };
        let Some(dev) = self.by_token.get_mut(&token) else {
            return;
        };
        if vm.is_some() {
            dev.vm = vm;
        }
        match msg {
            ToDaemon::ReadLanded {
                gfns,
                landed_ns,
                bases,
                ..
            } => {
                match vm {
                    Some(vm) if gfns.len() <= MAX_BATCH => {
                        // The time since the device wrote the pages, µs (0 if not said or
                        // not monotonic: a peer's clock is only a hint).
                        let now = memfold_sys::proc::monotonic_ns();
                        let age_us = if landed_ns > 0 && landed_ns <= now {
                            (now - landed_ns) / 1000
                        } else {
                            0
                        };
                        engine.read_landed(vm, &gfns, age_us);
                        let from_base: Vec<(Gfn, BaseBlock)> = bases
                            .iter()
                            .filter(|(_, b)| dev.bases.contains_key(&b.disk))
                            .filter_map(|&(i, b)| gfns.get(i as usize).map(|&g| (g, b)))
                            .collect();
                        engine.landed_from_base(vm, &from_base);
                    }
                    _ => guests.landed_dropped += gfns.len() as u64,
                }
            }
            ToDaemon::FillRead {
                fill, nonce, pages, ..
            } => {
                self.next_fill += 1;
                let ours = FillId(self.next_fill);
                self.fills.insert(ours, (token, fill));
                let pages: Vec<(Gfn, BaseBlock)> = pages
                    .into_iter()
                    .take(MAX_BATCH)
                    .filter(|(_, b)| dev.bases.contains_key(&b.disk))
                    .collect();
                match vm {
                    Some(vm) => {
                        engine.fill_read(vm, ours, &pages, nonce);
                    }
                    None => {
                        self.fills.remove(&ours);
                        self.answer(token, fill, Vec::new());
                    }
                }
            }
            other => tracing::warn!("block device {token} sent {other:?}; ignored"),
        }
    }

    /// The sharing domain of device `d`'s guest, if it named one still attached.
    fn domain_of(engine: &Engine, d: &Device) -> Option<DomainId> {
        d.vm.and_then(|v| engine.domain_of(v))
    }

    /// After a step: answers the fills the engine finished, and checks waiting
    /// candidates against their bases, telling each device that serves a base of the
    /// blocks now held.
    pub(crate) fn pump(&mut self, engine: &mut Engine) {
        for a in engine.take_fill_answers() {
            if let Some((token, theirs)) = self.fills.remove(&a.fill) {
                self.filled += a.filled.len() as u64;
                self.answer(token, theirs, a.filled);
            }
        }
        self.wait_to_check(engine.take_block_candidates());
        if self.unchecked.is_empty() {
            return;
        }
        let take = self.unchecked.len().min(MAX_CHECKS_PER_STEP);
        let batch: Vec<BlockCandidate> = self.unchecked.drain(..take).collect();
        let mut held: HashMap<(DomainId, DiskId), Vec<BaseBlock>> = HashMap::new();
        let mut page = Box::new(AlignedPage([0u8; PAGE_SIZE]));
        for c in batch {
            if engine.block_held_in(c.domain, c.block) {
                continue;
            }
            let Some(file) = self
                .by_token
                .values()
                .find_map(|d| d.bases.get(&c.block.disk))
            else {
                continue;
            };
            let Some(off) = c.block.block.checked_mul(PAGE_SIZE as u64) else {
                continue;
            };
            self.blocks_checked += 1;
            if let Err(e) = file.read_exact_at(&mut page.0, off) {
                tracing::debug!("{}: block {} unreadable: {e}", c.block.disk, c.block.block);
                continue;
            }
            let bytes: &Page = &page.0;
            if engine.block_verified(&c, bytes) {
                held.entry((c.domain, c.block.disk))
                    .or_default()
                    .push(c.block);
            }
        }
        for ((domain, disk), blocks) in held {
            for d in self.by_token.values().filter(|d| {
                d.bases.contains_key(&disk) && Self::domain_of(engine, d) == Some(domain)
            }) {
                d.tell_held(&blocks);
            }
        }
    }

    /// Queues `new` candidates behind those waiting, up to [`MAX_WAITING`]; the rest are
    /// dropped and counted.
    fn wait_to_check(&mut self, new: impl IntoIterator<Item = BlockCandidate>) {
        for c in new {
            if self.unchecked.len() < MAX_WAITING {
                self.unchecked.push_back(c);
            } else {
                self.unchecked_dropped += 1;
                // Said at the first drop and at each doubling: a count, not a flood.
                if self.unchecked_dropped.is_power_of_two() {
                    tracing::warn!(
                        "{} block candidates dropped so far: {MAX_WAITING} wait for their \
                         check against the base already (their blocks are not learnt as held)",
                        self.unchecked_dropped
                    );
                }
            }
        }
    }

    fn answer(&mut self, token: u64, fill: FillId, gfns: Vec<Gfn>) {
        self.fills_answered += 1;
        if let Some(d) = self.by_token.get(&token) {
            // A device too slow to read its answer has long given up on it.
            d.send(&ToDevice::Filled { fill, gfns });
        }
    }
}

/// The bases a device's hello names, each with the descriptor it passed in the same
/// place, kept only if the descriptor's file is the one the id names. Logged otherwise.
pub(crate) fn checked_bases(
    token: u64,
    ids: &[DiskId],
    fds: Vec<std::os::fd::OwnedFd>,
) -> Vec<(DiskId, File)> {
    let mut out = Vec::new();
    for (&id, fd) in ids.iter().zip(fds) {
        use std::os::fd::AsFd;
        match memfold_sys::memfd::file_id(fd.as_fd()) {
            Ok((dev, ino)) if DiskId::of_file(dev, ino) == id => {
                out.push((id, File::from(fd)));
            }
            Ok(_) => tracing::warn!(
                "block device {token}: its descriptor for {id} is another file; not taken"
            ),
            Err(e) => tracing::warn!("block device {token}: {id}: {e}; not taken"),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfold_core::ids::FrameId;

    /// Candidates come faster than they are checked: at most [`MAX_WAITING`] wait, the
    /// oldest first, the rest counted as dropped. Fails with every candidate queued.
    #[test]
    fn candidates_waiting_for_their_check_are_bounded() {
        let mut d = Devices::default();
        let candidate = |i: u64| BlockCandidate {
            domain: DomainId(0),
            frame: FrameId(i as u32),
            block: BaseBlock {
                disk: DiskId(1),
                block: i,
            },
        };
        for step in 0..3u64 {
            d.wait_to_check((0..MAX_WAITING as u64).map(|i| candidate(step * 10_000 + i)));
            d.unchecked.drain(..MAX_CHECKS_PER_STEP);
        }
        assert!(d.unchecked.len() <= MAX_WAITING, "{}", d.unchecked.len());
        assert_eq!(
            d.unchecked_dropped,
            2 * MAX_WAITING as u64 - 2 * MAX_CHECKS_PER_STEP as u64
        );
        assert_eq!(d.unchecked.front().map(|c| c.block.block), Some(768));
    }
}
