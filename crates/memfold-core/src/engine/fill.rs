//! Reads served from frames (Satori §5.2, copy-on-write disks): "if a guest reads a block
//! from the read-only substrate disk, the block number is sufficient to identify it
//! uniquely ... some reads can be satisfied without accessing the underlying physical
//! device". Satori keeps a block-number → machine-frame table and, on a read of a block
//! it holds, shares the guest's I/O buffer with that frame (`get_ro_ref`, `share_mfns`)
//! instead of reading the disk.
//!
//! Here the table is each domain's `BlockIndex`: base block → pool frame. Two rules
//! keep it true:
//! - **Learnt from the base, never from a guest page.** A page that landed from block b
//!   and was then shared onto frame F only makes (b, F) a [`BlockCandidate`]: the guest
//!   may have written its buffer between the device's write and the share, so F may not
//!   hold b. The mechanism reads b from the base itself and [`Engine::block_verified`]
//!   compares it with F's bytes; only then is b → F indexed.
//! - **An entry dies with its frame** (frames are reused): `Engine::forget_frame`
//!   drops it. Frames are never written while in use, so a live indexed frame holds b.
//!
//! A fill ([`Engine::fill_read`]) asks the agent to map F over each page of the read
//! whose block is indexed ([`super::Command::Fill`]), if the page still begins with the
//! device's nonce — the agent's check, under write-protection, that the device has not
//! written the page since (it gave up waiting and read the disk): a late fill never
//! hides a later write. The answer lists the pages filled; the device reads the others.

use std::collections::{BTreeMap, HashMap};

use super::{Command, Engine};
use crate::frames::FrameTable;
use crate::ids::{BaseBlock, DiskId, DomainId, FillId, FrameId, Gfn, VmId};
use crate::p2m::PageState;
use crate::{Page, PAGE_SIZE};

/// Blocks a domain's index holds at most (40 bytes each: 40 MiB for 4 GiB of distinct
/// base blocks held in frames); past it nothing more is learnt.
pub const MAX_INDEXED: usize = 1 << 20;

/// Pages one fill asks at most (the wire's batch); the rest are left to the disk.
pub const MAX_FILL: usize = 512;

/// Fills waiting for answers, and candidates waiting for the mechanism, at most; past
/// it the oldest fill is answered empty (its device has long given up) and new
/// candidates are dropped.
pub const MAX_WAITING: usize = 4096;

/// One domain's base blocks held by its pool frames.
#[derive(Debug, Default)]
pub(crate) struct BlockIndex {
    by_block: HashMap<BaseBlock, FrameId>,
    by_frame: HashMap<FrameId, Vec<BaseBlock>>,
}

impl BlockIndex {
    fn insert(&mut self, b: BaseBlock, f: FrameId) -> bool {
        if self.by_block.len() >= MAX_INDEXED || self.by_block.contains_key(&b) {
            return false;
        }
        self.by_block.insert(b, f);
        self.by_frame.entry(f).or_default().push(b);
        true
    }

    /// Frame `f` was freed: its blocks leave the index.
    pub(crate) fn forget_frame(&mut self, f: FrameId) {
        for b in self.by_frame.remove(&f).unwrap_or_default() {
            self.by_block.remove(&b);
        }
    }

    /// Blocks indexed.
    pub(crate) fn len(&self) -> usize {
        self.by_block.len()
    }

    /// Verifies the index against its domain's `frames`, for tests: each block names a
    /// frame in use (a fill maps it with only a nonce check: a freed, reused frame would
    /// give the guest other bytes) and listed under it, and each frame's blocks map back
    /// to it, once. Returns the first violation.
    pub(crate) fn check(&self, frames: &FrameTable) -> Result<(), String> {
        if self.by_block.len() > MAX_INDEXED {
            return Err(format!("{} blocks indexed", self.by_block.len()));
        }
        for (b, &f) in &self.by_block {
            if !frames.contains(f) || !frames.is_used(f) {
                return Err(format!("{b:?} indexed at {f}, which nothing holds"));
            }
            if !self.by_frame.get(&f).is_some_and(|bs| bs.contains(b)) {
                return Err(format!("{b:?} indexed at {f}, not listed under it"));
            }
        }
        let mut listed = 0;
        for (&f, bs) in &self.by_frame {
            if bs.is_empty() {
                return Err(format!("{f} listed with no block"));
            }
            if let Some(b) = bs.iter().find(|b| self.by_block.get(b) != Some(&f)) {
                return Err(format!("{b:?} listed under {f}, indexed elsewhere"));
            }
            listed += bs.len();
        }
        // Every listed block maps back to its frame: more listed than indexed is a block
        // listed twice.
        if listed != self.by_block.len() {
            return Err(format!(
                "{listed} blocks listed by frame, {} indexed",
                self.by_block.len()
            ));
        }
        Ok(())
    }
}

/// A page that landed from base block `block` and was shared onto `frame`: maybe `block`
/// is `frame`, if the base says so ([`Engine::block_verified`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCandidate {
    /// The frame's domain.
    pub domain: DomainId,
    /// The frame.
    pub frame: FrameId,
    /// The block the page landed from.
    pub block: BaseBlock,
}

/// A fill's answer: the pages of guest `vm` now mapped onto frames holding what the read
/// asked for; the device reads the rest from the disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FillAnswer {
    /// The guest.
    pub vm: VmId,
    /// The device's request.
    pub fill: FillId,
    /// Pages filled.
    pub filled: Vec<Gfn>,
}

struct Waiting {
    left: u32,
    filled: Vec<Gfn>,
    /// Its place in the order fills were asked: the oldest is answered first when
    /// [`MAX_WAITING`] wait.
    seq: u64,
}

/// The engine's state of fills and of the block indexes.
#[derive(Default)]
pub(crate) struct Fills {
    pub(crate) index: BTreeMap<DomainId, BlockIndex>,
    /// Pages that landed from a base block, while their share at read is under way.
    landed: HashMap<(VmId, Gfn), BaseBlock>,
    candidates: Vec<BlockCandidate>,
    /// Fill commands under way: their request, and its [`Waiting::seq`] (a device may
    /// ask again under the id of a fill answered early past [`MAX_WAITING`], whose pages
    /// are still under way: their answers are not the new fill's).
    filling: HashMap<(VmId, Gfn), (FillId, u64)>,
    waiting: BTreeMap<(VmId, FillId), Waiting>,
    /// The next fill's [`Waiting::seq`].
    next_seq: u64,
    answers: Vec<FillAnswer>,
}

impl Engine {
    /// Pages of guest `id` that [`Engine::read_landed`] was just told of came from these
    /// base blocks (Satori §4.1). Each page whose share at read is under way is
    /// remembered; if it ends mapped onto a frame, (block, frame) becomes a
    /// [`BlockCandidate`].
    pub fn landed_from_base(&mut self, id: VmId, pages: &[(Gfn, BaseBlock)]) {
        let Some(v) = self.vms.get(&id).filter(|_| self.cfg.read_fill) else {
            return;
        };
        for &(g, b) in pages {
            if v.read_sharing.contains_key(&g) {
                self.fills.landed.insert((id, g), b);
            }
        }
    }

    /// Guest `id`'s shares at read still under way ended with its connection, or with the
    /// guest: no answer will come for the pages landed from base blocks among them.
    pub(crate) fn forget_landed(&mut self, id: VmId) {
        self.fills.landed.retain(|(vm, _), _| *vm != id);
    }

    /// The share at read of page `g` of guest `id` was answered: a landed page now mapped
    /// onto `frame` is a candidate.
    pub(crate) fn landed_share_answered(&mut self, id: VmId, g: Gfn, frame: Option<FrameId>) {
        let Some(block) = self.fills.landed.remove(&(id, g)) else {
            return;
        };
        if let Some(frame) = frame {
            if self.fills.candidates.len() < MAX_WAITING {
                let domain = self.dom(id);
                self.fills.candidates.push(BlockCandidate {
                    domain,
                    frame,
                    block,
                });
            }
        }
    }

    /// Candidates for the mechanism to check against the base.
    pub fn take_block_candidates(&mut self) -> Vec<BlockCandidate> {
        std::mem::take(&mut self.fills.candidates)
    }

    /// The mechanism read candidate `c`'s block from the base: `base` is its bytes. If the
    /// frame is in use and holds exactly those bytes, the block is indexed as held by it.
    /// Returns whether it was (newly) indexed.
    pub fn block_verified(&mut self, c: &BlockCandidate, base: &Page) -> bool {
        let Some(dom) = self.domains.get(&c.domain) else {
            return false;
        };
        if !dom.frames.contains(c.frame) || !dom.frames.is_used(c.frame) {
            return false;
        }
        let mut held: Box<Page> = Box::new([0u8; PAGE_SIZE]);
        if dom.pool.read(c.frame.offset(), &mut held[..]).is_err() || *held != *base {
            return false;
        }
        let indexed = self
            .fills
            .index
            .entry(c.domain)
            .or_default()
            .insert(c.block, c.frame);
        if indexed {
            self.books.blocks_indexed += 1;
        }
        indexed
    }

    /// The disks of which some domain's frames hold a block (each once, any order).
    pub fn indexed_disks(&self) -> std::collections::HashSet<DiskId> {
        self.fills
            .index
            .values()
            .flat_map(|i| i.by_block.keys().map(|b| b.disk))
            .collect()
    }

    /// Whether base block `b` is indexed in domain `d`.
    pub fn block_held_in(&self, d: DomainId, b: BaseBlock) -> bool {
        self.fills
            .index
            .get(&d)
            .is_some_and(|i| i.by_block.contains_key(&b))
    }

    /// Base blocks domain `d`'s frames hold, of the disks `of` accepts: at most `max`,
    /// any of them (the index's order). What a block device that names a guest of `d`
    /// after they were learnt (a restarted device, a guest started later) is told, so
    /// its reads of them are filled too (Satori §5.2). Each names the bytes of its
    /// disk as they are now ([`crate::ids::DiskId`] covers size and mtime).
    pub fn blocks_held_of(
        &self,
        d: DomainId,
        of: impl Fn(DiskId) -> bool,
        max: usize,
    ) -> Vec<BaseBlock> {
        self.fills.index.get(&d).map_or_else(Vec::new, |i| {
            i.by_block
                .keys()
                .filter(|b| of(b.disk))
                .take(max)
                .copied()
                .collect()
        })
    }

    /// Whether base block `b` is held by a frame of guest `id`'s domain.
    pub fn block_held(&self, id: VmId, b: BaseBlock) -> bool {
        self.vms.contains_key(&id) && self.block_held_in(self.dom(id), b)
    }

    /// A block device asks (request `fill`) that pages `pages` of guest `id` be filled
    /// with base blocks from frames instead of the disk (Satori §5.2); it wrote `nonce`
    /// at the start of each. Each private page whose block is indexed is asked of the
    /// agent ([`Command::Fill`]); the answer ([`Engine::take_fill_answers`]) comes when
    /// the agent has answered them all — at once if none was asked. Returns the pages
    /// asked.
    pub fn fill_read(
        &mut self,
        id: VmId,
        fill: FillId,
        pages: &[(Gfn, BaseBlock)],
        nonce: [u64; 2],
    ) -> u32 {
        let mut asked = 0;
        let attached = self
            .vms
            .get(&id)
            .is_some_and(|v| v.attached && !v.opted_out);
        let key = (id, fill);
        // This request's sequence number, taken below if it asks anything.
        let seq = self.fills.next_seq;
        if self.cfg.read_fill
            && attached
            && nonce != [0, 0]
            && !self.fills.waiting.contains_key(&key)
        {
            let d = self.dom(id);
            let ram = self.vms[&id].pages();
            for &(g, b) in pages.iter().take(MAX_FILL) {
                // A device names pages by the RAM file QEMU gave it, which may be longer
                // than the RAM its agent attached: a page past it is not this guest's.
                if g.0 >= ram {
                    continue;
                }
                let Some(&f) = self.fills.index.get(&d).and_then(|i| i.by_block.get(&b)) else {
                    continue;
                };
                // The read will overwrite it: a paged-out mark goes (kernel_swap.rs).
                if let Some(v) = self.vms.get_mut(&id).filter(|v| v.paged_out_or_going(g)) {
                    v.set(g, PageState::Private);
                }
                if !self.sharable(id, g)
                    || self.never_share(id, g) // never_share.rs
                    || self.withdrawn(d, f)
                    || self.vms[&id].state(g) != PageState::Private
                {
                    continue;
                }
                self.domain_mut(d).frames.add_pending(f);
                let v = self.vms.get_mut(&id).expect("attached");
                v.hints.age_reset(g);
                v.set(g, PageState::Sharing(f));
                v.queue.push(Command::Fill {
                    gfn: g,
                    frame: f,
                    nonce,
                });
                self.fills.filling.insert((id, g), (fill, seq));
                asked += 1;
            }
        }
        if asked == 0 {
            self.fills.answers.push(FillAnswer {
                vm: id,
                fill,
                filled: Vec::new(),
            });
        } else {
            if self.fills.waiting.len() >= MAX_WAITING {
                // The oldest, whichever guest asked it (by key, the lowest guest id's
                // went first: one busy guest's device could starve another's). A scan of
                // the waiting fills, only when they are this many.
                let oldest = self
                    .fills
                    .waiting
                    .iter()
                    .min_by_key(|(_, w)| w.seq)
                    .map(|(k, _)| *k);
                if let Some((vm, old)) = oldest {
                    let w = self.fills.waiting.remove(&(vm, old)).expect("found");
                    self.fills.answers.push(FillAnswer {
                        vm,
                        fill: old,
                        filled: w.filled,
                    });
                }
            }
            self.fills.next_seq += 1;
            self.fills.waiting.insert(
                key,
                Waiting {
                    left: asked,
                    filled: Vec::new(),
                    seq,
                },
            );
        }
        asked
    }

    /// The agent answered the fill of page `g` of guest `id` (`mapped` or not, lost
    /// included).
    pub(crate) fn fill_answered(&mut self, id: VmId, g: Gfn, mapped: bool) {
        let Some((fill, seq)) = self.fills.filling.remove(&(id, g)) else {
            return;
        };
        if mapped {
            if let Some(v) = self.vms.get_mut(&id) {
                // A share made at read too, without the disk.
                v.books.read_fills += 1;
                v.books.read_shares += 1;
            }
        }
        let key = (id, fill);
        // Not a page of the fill waiting under this id now (one answered early's).
        let Some(w) = self.fills.waiting.get_mut(&key).filter(|w| w.seq == seq) else {
            return;
        };
        if mapped {
            w.filled.push(g);
        }
        w.left -= 1;
        if w.left == 0 {
            let w = self.fills.waiting.remove(&key).expect("just seen");
            self.fills.answers.push(FillAnswer {
                vm: id,
                fill,
                filled: w.filled,
            });
        }
    }

    /// Fills answered since the last call, for the mechanism to tell the devices.
    pub fn take_fill_answers(&mut self) -> Vec<FillAnswer> {
        std::mem::take(&mut self.fills.answers)
    }

    /// Verifies each domain's block index and the fills' books, for tests. A guest's
    /// fills under way name pages in flight, none also a share at read; each waiting fill
    /// still has its pages to hear from (or its device would wait for good); the pages
    /// landed from base blocks are shares at read under way; the queues keep their
    /// bounds. A guest removed with fills under way leaves them behind (`Engine::remove`
    /// keeps them; guest ids are never reused, so no later guest's page is taken for
    /// one): only a live guest's are checked. Returns the first violation.
    pub(crate) fn check_fills(&self) -> Result<(), String> {
        let fl = &self.fills;
        for (d, i) in &fl.index {
            let Some(dom) = self.domains.get(d) else {
                return Err(format!("a block index of {d}, which is gone"));
            };
            i.check(&dom.frames)
                .map_err(|e| format!("block index of {d}: {e}"))?;
        }
        if fl.waiting.len() > MAX_WAITING || fl.candidates.len() > MAX_WAITING {
            return Err(format!(
                "{} fills waiting, {} block candidates",
                fl.waiting.len(),
                fl.candidates.len()
            ));
        }
        let mut naming: HashMap<(VmId, FillId, u64), u32> = HashMap::new();
        for (&(id, g), &(fill, seq)) in &fl.filling {
            *naming.entry((id, fill, seq)).or_default() += 1;
            let Some(v) = self.vms.get(&id) else {
                continue;
            };
            // The mechanism answers every command sent, `Lost` at worst, before a detach;
            // each answer ends its fill (`fill_answered`).
            if !v.attached || g.0 >= v.pages() {
                return Err(format!(
                    "{id} {g}: a fill under way, guest detached or too small"
                ));
            }
            if !matches!(v.state(g), PageState::Sharing(_)) || v.read_sharing.contains_key(&g) {
                return Err(format!(
                    "{id} {g}: a fill under way for a page in {:?}, a share at read {}",
                    v.state(g),
                    v.read_sharing.contains_key(&g)
                ));
            }
        }
        // Exactly: a fill evicted past MAX_WAITING leaves its pages under way under its
        // own sequence number, whatever id a later fill has.
        for (&(id, fill), w) in &fl.waiting {
            let n = naming.get(&(id, fill, w.seq)).copied().unwrap_or(0);
            if w.left == 0 || n != w.left {
                return Err(format!(
                    "{id} {fill:?}: waits for {} pages, {n} under way",
                    w.left
                ));
            }
        }
        for &(id, g) in fl.landed.keys() {
            if !self
                .vms
                .get(&id)
                .is_some_and(|v| v.read_sharing.contains_key(&g))
            {
                return Err(format!(
                    "{id} {g}: landed from a base block, no share at read"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::DiskId;
    use crate::sim::Rig;
    use crate::{EngineConfig, Policy};

    const PAGES: u32 = 32;
    const NONCE: [u64; 2] = [0xfeed_f00d, 42];
    const B: BaseBlock = BaseBlock {
        disk: DiskId(7),
        block: 1234,
    };

    /// Sharing only, and no scan: every share here is made at read.
    fn rig() -> Rig {
        rig_of(PAGES)
    }

    /// [`rig`] with a guest of `pages` pages.
    fn rig_of(pages: u32) -> Rig {
        let cfg = EngineConfig {
            policy: Policy::sharing_only(),
            read_fill: true,
            rate: 0,
            min_scan_interval_us: 3_600_000_000,
            max_scan_interval_us: 3_600_000_000,
            ..EngineConfig::default()
        };
        let mut r = Rig::new(cfg, pages).unwrap();
        for g in 0..pages {
            r.agent
                .write(Gfn(g), 0, &[(g as u8).wrapping_add(1); PAGE_SIZE])
                .unwrap();
        }
        r
    }

    /// The bytes of base block `B`.
    fn block() -> Vec<u8> {
        (0..PAGE_SIZE).map(|i| (i % 251) as u8 ^ 0x5a).collect()
    }

    /// Pages `gfns` land from block `B` and are reported, with their block.
    fn land(r: &mut Rig, gfns: &[u32]) {
        for &g in gfns {
            r.agent.write(Gfn(g), 0, &block()).unwrap();
        }
        let gs: Vec<Gfn> = gfns.iter().map(|&g| Gfn(g)).collect();
        r.engine.read_landed(r.vm, &gs, 0);
        let pages: Vec<(Gfn, BaseBlock)> = gs.iter().map(|&g| (g, B)).collect();
        r.engine.landed_from_base(r.vm, &pages);
        r.carry_out();
    }

    fn nonce_bytes() -> Vec<u8> {
        [NONCE[0].to_ne_bytes(), NONCE[1].to_ne_bytes()].concat()
    }

    /// Two reads of block B share their pages onto a frame, which makes (B, frame) a
    /// candidate; the base's bytes, not the guest's, index it.
    fn learnt() -> (Rig, BlockCandidate) {
        learnt_in(rig())
    }

    /// [`learnt`] in rig `r`.
    fn learnt_in(mut r: Rig) -> (Rig, BlockCandidate) {
        land(&mut r, &[3, 20]);
        let cands = r.engine.take_block_candidates();
        assert!(!cands.is_empty(), "a landed page shared is a candidate");
        let c = cands[0];
        assert_eq!(c.block, B);
        let mut wrong: Box<Page> = Box::new([0u8; PAGE_SIZE]);
        wrong.copy_from_slice(&block());
        wrong[100] ^= 1;
        assert!(!r.engine.block_verified(&c, &wrong), "the base disagrees");
        assert!(!r.engine.block_held(r.vm, B));
        let mut base: Box<Page> = Box::new([0u8; PAGE_SIZE]);
        base.copy_from_slice(&block());
        assert!(r.engine.block_verified(&c, &base));
        assert!(r.engine.block_held(r.vm, B));
        (r, c)
    }

    /// A landed page whose share at read was lost with the connection is forgotten when
    /// the agent attaches again, and with the guest: it was kept for good before.
    #[test]
    fn landed_pages_whose_answers_were_lost_are_forgotten() {
        let mut r = rig();
        for g in [3, 20] {
            r.agent.write(Gfn(g), 0, &block()).unwrap();
        }
        r.engine.read_landed(r.vm, &[Gfn(3), Gfn(20)], 0);
        r.engine
            .landed_from_base(r.vm, &[(Gfn(3), B), (Gfn(20), B)]);
        for c in r.engine.take_commands(r.vm) {
            r.engine.outcome(r.vm, &c, crate::engine::Outcome::Lost);
        }
        assert!(
            !r.engine.fills.landed.is_empty(),
            "the shares at read were under way"
        );
        r.engine.detach(r.vm);
        assert_eq!(r.reattach().unwrap(), r.vm);
        assert!(
            r.engine.fills.landed.is_empty(),
            "{:?}",
            r.engine.fills.landed
        );
    }

    #[test]
    fn a_read_of_a_held_block_is_filled_from_its_frame_without_the_disk() {
        let (mut r, c) = learnt();
        // The device wrote its nonce over the guest's old data and asks.
        r.agent.write(Gfn(10), 0, &nonce_bytes()).unwrap();
        assert_eq!(
            r.engine.fill_read(r.vm, FillId(1), &[(Gfn(10), B)], NONCE),
            1
        );
        assert!(
            r.engine.take_fill_answers().is_empty(),
            "not before the agent"
        );
        r.carry_out();
        let a = r.engine.take_fill_answers();
        assert_eq!(
            a,
            [FillAnswer {
                vm: r.vm,
                fill: FillId(1),
                filled: vec![Gfn(10)]
            }]
        );
        assert_eq!(r.agent.peek(Gfn(10)).unwrap().to_vec(), block());
        assert_eq!(
            r.engine.page_state(r.vm, Gfn(10)).unwrap(),
            PageState::Shared(c.frame)
        );
        let books = r.engine.books();
        assert_eq!(books.vms[0].books.read_fills, 1);
        assert_eq!((books.blocks_indexed, books.blocks_held), (1, 1));
        r.engine.check_invariants().unwrap();
    }

    /// What a device that names its guest late is told: its domain's blocks of the
    /// disks it serves, at most as many as asked. Fails with either filter left out.
    #[test]
    fn blocks_held_are_listed_by_domain_and_disk() {
        let (r, _) = learnt();
        let d = r.engine.domain_of(r.vm).unwrap();
        let of = |disk: DiskId| move |x: DiskId| x == disk;
        assert_eq!(r.engine.blocks_held_of(d, of(B.disk), 10), [B]);
        assert_eq!(r.engine.blocks_held_of(d, of(DiskId(8)), 10), []);
        assert_eq!(r.engine.blocks_held_of(d, of(B.disk), 0), []);
        assert_eq!(
            r.engine.blocks_held_of(DomainId(d.0 + 1), of(B.disk), 10),
            []
        );
    }

    /// The device gave up and wrote the disk's bytes, then the guest wrote: a fill
    /// arriving after is refused by the nonce and hides nothing.
    #[test]
    fn a_late_fill_never_hides_a_later_write() {
        let (mut r, _) = learnt();
        r.agent.write(Gfn(11), 0, &nonce_bytes()).unwrap();
        assert_eq!(
            r.engine.fill_read(r.vm, FillId(2), &[(Gfn(11), B)], NONCE),
            1
        );
        r.agent.write(Gfn(11), 0, &block()).unwrap();
        r.agent.write(Gfn(11), 0, b"the guest's own").unwrap();
        r.carry_out();
        let a = r.engine.take_fill_answers();
        assert_eq!(a[0].filled, Vec::<Gfn>::new());
        let mut want = block();
        want[..15].copy_from_slice(b"the guest's own");
        assert_eq!(r.agent.peek(Gfn(11)).unwrap().to_vec(), want);
        assert_eq!(
            r.engine.page_state(r.vm, Gfn(11)).unwrap(),
            PageState::Private
        );
        r.engine.check_invariants().unwrap();
    }

    /// Pages that are not private, blocks not held, a zero nonce, pages past the guest's
    /// RAM (a QEMU whose memfd is longer than the RAM its agent attached): nothing asked,
    /// and the device is answered at once.
    #[test]
    fn what_cannot_be_filled_is_answered_at_once() {
        let (mut r, _) = learnt();
        let other = BaseBlock {
            disk: DiskId(7),
            block: 1,
        };
        assert_eq!(
            r.engine
                .fill_read(r.vm, FillId(3), &[(Gfn(3), B), (Gfn(12), other)], NONCE),
            0
        );
        assert_eq!(
            r.engine.fill_read(r.vm, FillId(4), &[(Gfn(12), B)], [0, 0]),
            0
        );
        let past = [(Gfn(PAGES), B), (Gfn(u32::MAX), B)];
        assert_eq!(r.engine.fill_read(r.vm, FillId(5), &past, NONCE), 0);
        let a = r.engine.take_fill_answers();
        assert_eq!(a.len(), 3);
        assert!(a.iter().all(|a| a.filled.is_empty()));
        r.engine.check_invariants().unwrap();
    }

    /// A rig with `n` = [`MAX_WAITING`] + 1 fills asked, one page each (page 100 + i
    /// under id n − i: the oldest has the highest id), so the oldest was answered early.
    fn one_fill_past_max_waiting() -> (Rig, u32) {
        let n = MAX_WAITING as u32 + 1;
        let (mut r, _) = learnt_in(rig_of(n + 100));
        for i in 0..n {
            let fill = FillId((n - i) as u64);
            let asked = r.engine.fill_read(r.vm, fill, &[(Gfn(100 + i), B)], NONCE);
            assert_eq!(asked, 1);
        }
        (r, n)
    }

    /// Past [`MAX_WAITING`] fills waiting, the oldest is answered first, whatever its id
    /// (ids are the devices'; by key, the lowest guest id's and then the lowest fill id's
    /// went first). Fails with the eviction by key.
    #[test]
    fn past_max_waiting_the_oldest_fill_is_answered_first() {
        let (mut r, n) = one_fill_past_max_waiting();
        let a = r.engine.take_fill_answers();
        assert_eq!(a.len(), 1, "one fill answered to make room");
        assert_eq!(a[0].fill, FillId(n as u64), "the oldest");
        r.engine.check_invariants().unwrap();
    }

    /// The device asks again under the id of the fill answered early (its page 100 still
    /// under way): the new fill hears only of its own page, 50, not of page 100's answer
    /// (it was answered when page 100's came, naming nothing, and page 50's dropped).
    /// Fails with the fills' pages keyed by id alone.
    #[test]
    fn a_fill_asked_again_under_an_answered_ones_id_hears_only_its_own_pages() {
        let (mut r, n) = one_fill_past_max_waiting();
        assert_eq!(r.engine.take_fill_answers()[0].fill, FillId(n as u64));
        r.agent.write(Gfn(50), 0, &nonce_bytes()).unwrap();
        let again = FillId(n as u64);
        assert_eq!(r.engine.fill_read(r.vm, again, &[(Gfn(50), B)], NONCE), 1);
        r.engine.check_invariants().unwrap();
        r.carry_out();
        let mine: Vec<FillAnswer> = r
            .engine
            .take_fill_answers()
            .into_iter()
            .filter(|a| a.fill == again)
            .collect();
        assert_eq!(
            mine,
            [FillAnswer {
                vm: r.vm,
                fill: again,
                filled: vec![Gfn(50)]
            }]
        );
        r.engine.check_invariants().unwrap();
    }

    /// A frame freed takes its blocks out of the index: frames are reused; and its disk
    /// out of the indexed ones (memfoldd may then let another file take the disk's id).
    #[test]
    fn a_freed_frame_leaves_the_index() {
        let (mut r, _) = learnt();
        assert_eq!(r.engine.indexed_disks(), [B.disk].into_iter().collect());
        for g in [3, 20] {
            r.agent.write(Gfn(g), 0, b"x").unwrap();
        }
        r.carry_out();
        assert!(!r.engine.block_held(r.vm, B), "the frame was freed");
        assert_eq!(r.engine.books().blocks_held, 0);
        assert!(r.engine.indexed_disks().is_empty());
        r.engine.check_invariants().unwrap();
    }
}
