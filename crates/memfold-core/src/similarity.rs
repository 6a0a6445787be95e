//! Finding similar pages: HashSimilarityDetector(k, s) (Difference Engine §3.2, §4.3).

use rand::{rngs::SmallRng, seq::index::sample, SeedableRng};
use serde::Serialize;

use crate::ids::{FrameId, Gpn};
use crate::{Page, PAGE_SIZE};

/// Size of a hashed block, bytes (DE §3.2).
pub const BLOCK: usize = 64;
const BLOCKS_PER_PAGE: usize = PAGE_SIZE / BLOCK;

/// Parameters of HashSimilarityDetector(k, s) with c candidates (DE §3.2, Figure 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SimilarityConfig {
    /// k: how many separate indexes a page gets (groups), 1..=8.
    pub groups: u8,
    /// s: how many 64-byte blocks are hashed together into one index, 1..=8.
    pub blocks_per_group: u8,
    /// c: how many candidate pages a bucket keeps (the first c found), 1..=8.
    pub candidates: u8,
    /// Width of each index in bits, 8..=32 (DE used 18; reports 32 better).
    pub hash_bits: u8,
    /// Seed choosing the fixed random block offsets.
    pub seed: u64,
}

impl Default for SimilarityConfig {
    /// HashSimilarityDetector(2,1), one candidate, 32-bit indexes: the paper's choice with
    /// the wider hash it found better.
    fn default() -> Self {
        SimilarityConfig {
            groups: 2,
            blocks_per_group: 1,
            candidates: 1,
            hash_bits: 32,
            seed: 0x6d_656d_666f_6c64,
        }
    }
}

/// Computes a page's k similarity signatures from blocks at fixed random offsets.
#[derive(Clone, Debug)]
pub struct SimilarityDetector {
    cfg: SimilarityConfig,
    /// Block indexes (0..64), `groups * blocks_per_group` of them, all distinct.
    blocks: Vec<u8>,
}

impl SimilarityDetector {
    /// Builds a detector. Errors name the out-of-range parameter.
    pub fn new(cfg: SimilarityConfig) -> Result<Self, String> {
        let check = |v: u8, lo: u8, hi: u8, name: &str| {
            if v < lo || v > hi {
                Err(format!("similarity {name} = {v}, must be in {lo}..={hi}"))
            } else {
                Ok(())
            }
        };
        check(cfg.groups, 1, 8, "groups (k)")?;
        check(cfg.blocks_per_group, 1, 8, "blocks per group (s)")?;
        check(cfg.candidates, 1, 8, "candidates (c)")?;
        check(cfg.hash_bits, 8, 32, "hash bits")?;
        let n = cfg.groups as usize * cfg.blocks_per_group as usize;
        let mut rng = SmallRng::seed_from_u64(cfg.seed);
        let blocks = sample(&mut rng, BLOCKS_PER_PAGE, n)
            .into_iter()
            .map(|b| b as u8)
            .collect();
        Ok(SimilarityDetector { cfg, blocks })
    }

    /// The configuration.
    pub fn config(&self) -> &SimilarityConfig {
        &self.cfg
    }

    /// The hashed blocks' indexes (0..64, block i covers bytes 64*i..64*i+64), group by group.
    pub fn blocks(&self) -> &[u8] {
        &self.blocks
    }

    /// The page's signature for each group, `hash_bits` wide. Uniform pages (zero pages,
    /// pages filled with one byte) give signatures like any other page; the caller skips
    /// zero pages.
    pub fn signatures(&self, page: &Page) -> [u32; 8] {
        let mut sigs = [0u32; 8];
        let s = self.cfg.blocks_per_group as usize;
        let mask = if self.cfg.hash_bits == 32 {
            u32::MAX
        } else {
            (1u32 << self.cfg.hash_bits) - 1
        };
        for (g, sig) in sigs.iter_mut().take(self.cfg.groups as usize).enumerate() {
            let h = if s == 1 {
                let b = self.blocks[g] as usize * BLOCK;
                xxhash_rust::xxh3::xxh3_64(&page[b..b + BLOCK])
            } else {
                let mut buf = [0u8; 8 * BLOCK];
                for (j, &blk) in self.blocks[g * s..(g + 1) * s].iter().enumerate() {
                    let b = blk as usize * BLOCK;
                    buf[j * BLOCK..(j + 1) * BLOCK].copy_from_slice(&page[b..b + BLOCK]);
                }
                xxhash_rust::xxh3::xxh3_64(&buf[..s * BLOCK])
            };
            *sig = (h as u32) & mask;
        }
        sigs
    }
}

/// A reference page candidate (DE §3.2): a guest page, or a pool frame (which no guest
/// can write, so a patch against it stays valid). Packed into 31 bits + a tag bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RefPage {
    /// A guest page, by its global page number.
    Guest(Gpn),
    /// A pool frame.
    Frame(FrameId),
}

const FRAME_TAG: u32 = 1 << 31;

impl RefPage {
    fn pack(self) -> u32 {
        match self {
            RefPage::Guest(g) => g.0 & !FRAME_TAG,
            RefPage::Frame(f) => f.0 | FRAME_TAG,
        }
    }

    fn unpack(v: u32) -> RefPage {
        if v & FRAME_TAG != 0 {
            RefPage::Frame(FrameId(v & !FRAME_TAG))
        } else {
            RefPage::Guest(Gpn(v))
        }
    }
}

/// The page-similarity hash table (DE §4.3): for each group a direct-mapped array of
/// buckets, each holding up to c candidate pages by gpn (4 bytes a slot, `u32::MAX` when
/// empty). Like the paper's 18-bit table it has a fixed size per cycle: 2^table_bits buckets
/// per group, table_bits = ⌈log2(n)⌉ − 1 for the `n` of [`Self::clear_for`], at most
/// `hash_bits` (the paper sizes it by managed pages: 2^18 buckets for 2 GiB; the engine
/// does so for the first cycle, then by the candidates a cycle offered,
/// [`Self::offered`]). A bucket keeps the first c pages that land in it.
///
/// Several signatures may share a bucket, so a candidate is only a hint: the caller
/// recomputes the candidate's signatures from its current content
/// ([`SimilarityIndex::matches`]), which also weeds out candidates that changed since they
/// were indexed. The table is kept across share passes and cleared and resized once per
/// clock cycle, and sooner when a cycle offers more pages than it can grow to hold
/// (the engine's `refresh_similarity_index`).
pub struct SimilarityIndex {
    det: SimilarityDetector,
    slots: Vec<u32>,
    table_bits: u8,
    len: usize,
    offered: usize,
    cycles: u64,
    /// The frames indexed again after every clear ([`Self::keep`]), by frame id: each
    /// its id followed by its `groups` signatures, sorted by id.
    kept: Vec<u32>,
}

const EMPTY: u32 = u32::MAX;
/// The smallest table's bits, unless the hash is narrower (8 or 9 bits: then the hash's).
const MIN_TABLE_BITS: u8 = 10;

impl SimilarityIndex {
    /// An empty index for this detector, with the smallest table.
    pub fn new(det: SimilarityDetector) -> Self {
        let table_bits = MIN_TABLE_BITS.min(det.cfg.hash_bits);
        SimilarityIndex {
            det,
            slots: Vec::new(),
            table_bits,
            len: 0,
            offered: 0,
            cycles: 0,
            kept: Vec::new(),
        }
    }

    /// The detector.
    pub fn detector(&self) -> &SimilarityDetector {
        &self.det
    }

    fn bucket(&self, group: usize, sig: u32) -> std::ops::Range<usize> {
        let c = self.det.cfg.candidates as usize;
        let b = (sig as usize) & ((1usize << self.table_bits) - 1);
        let start = ((group << self.table_bits) + b) * c;
        start..start + c
    }

    /// Indexes page `gpn` under its signatures, in each bucket that has a free slot and
    /// does not hold it yet. Returns how many buckets took it.
    pub fn insert(&mut self, sigs: &[u32; 8], page: RefPage) -> usize {
        let gpn = page.pack();
        if self.slots.is_empty() {
            // Allocated on first use: policies that never patch pay nothing.
            let n = ((self.det.cfg.groups as usize) << self.table_bits)
                * self.det.cfg.candidates as usize;
            self.slots = vec![EMPTY; n];
        }
        let (mut taken, mut held) = (0, false);
        for (g, &sig) in sigs.iter().enumerate().take(self.det.cfg.groups as usize) {
            let r = self.bucket(g, sig);
            let bucket = &mut self.slots[r];
            if bucket.contains(&gpn) {
                held = true;
                continue;
            }
            if let Some(slot) = bucket.iter_mut().find(|s| **s == EMPTY) {
                *slot = gpn;
                taken += 1;
            }
        }
        // A page offered again while indexed counts once; one every bucket refused counts
        // again (a full table under-counts by what it drops otherwise).
        if !held {
            self.offered += 1;
        }
        self.len += taken;
        taken
    }

    /// Indexes `to` in place of `from` (a guest page just copied into pool frame `to` to
    /// serve as a patch's reference, DE §4.3) in the buckets of `sigs`: where `from` sits
    /// it takes its slot, elsewhere a free one. Without this the guest page, no longer a
    /// candidate once shared onto the frame, keeps its slots until the next clear, and
    /// with one candidate a bucket (the paper's c = 1) the frame is refused: every
    /// further near-duplicate would promote a reference frame of its own. Not counted as
    /// offered (the page was). Returns how many buckets hold `to` afterwards.
    pub fn replace(&mut self, sigs: &[u32; 8], from: RefPage, to: RefPage) -> usize {
        let (from, to) = (from.pack(), to.pack());
        if self.slots.is_empty() {
            return 0;
        }
        let mut held = 0;
        for (g, &sig) in sigs.iter().enumerate().take(self.det.cfg.groups as usize) {
            let r = self.bucket(g, sig);
            let bucket = &mut self.slots[r];
            if bucket.contains(&to) {
                held += 1;
            } else if let Some(slot) = bucket.iter_mut().find(|s| **s == from) {
                *slot = to;
                held += 1;
            } else if let Some(slot) = bucket.iter_mut().find(|s| **s == EMPTY) {
                *slot = to;
                self.len += 1;
                held += 1;
            }
        }
        held
    }

    /// Candidate pages from the page's buckets, without duplicates, at most k*c. Verify
    /// each with [`Self::matches`].
    pub fn candidates(&self, sigs: &[u32; 8], out: &mut Vec<RefPage>) {
        out.clear();
        if self.slots.is_empty() {
            return;
        }
        for (g, &sig) in sigs.iter().enumerate().take(self.det.cfg.groups as usize) {
            for &gpn in &self.slots[self.bucket(g, sig)] {
                if gpn != EMPTY && !out.contains(&RefPage::unpack(gpn)) {
                    out.push(RefPage::unpack(gpn));
                }
            }
        }
    }

    /// Whether a candidate's current content shares at least one signature with `sigs`.
    pub fn matches(&self, sigs: &[u32; 8], candidate: &Page) -> bool {
        let theirs = self.det.signatures(candidate);
        (0..self.det.cfg.groups as usize).any(|g| theirs[g] == sigs[g])
    }

    /// Forgets every candidate (end of a clock cycle, DE §4.3) and sizes the table for
    /// `n` pages: n/2 buckets a group (rounded up to a power of two; at least 2^10, at
    /// most 2^hash_bits). DE's `n` is the managed guest pages. The kept frames
    /// ([`Self::keep`]) are indexed again at once, in frame order, and count as offered.
    pub fn clear_for(&mut self, n: u64) {
        self.table_bits = self.table_bits_for(n);
        self.slots = Vec::new();
        self.len = 0;
        self.offered = 0;
        self.cycles += 1;
        let frames: Vec<FrameId> = self.kept_frames().collect();
        for f in frames {
            let mut sigs = [0u32; 8];
            let kept = self.kept_signatures(f).expect("kept");
            sigs[..kept.len()].copy_from_slice(kept);
            self.insert(&sigs, RefPage::Frame(f));
        }
    }

    /// Keeps frame `f` (a guest page copied into the pool as a patch's reference), whose
    /// signatures are `sigs`, across clears: DE §4.3's reference page serves every page
    /// similar to it, but the clock offers guest pages, never frames, so a frame indexed
    /// once would be forgotten at the next clear, and each later near-duplicate would
    /// promote a reference of its own. (Every shared frame kept too was measured and
    /// left out: no saving, more CPU — docs/live-de.md.) A frame kept again takes its new
    /// signatures (the engine forgets a freed frame first, [`Self::forget_frame`]). 4
    /// bytes a group and 4 more a kept frame (a table by frame id, measured, cost more:
    /// reference frames are few and far apart in the pool); [`Self::retain_kept`] drops
    /// the ones nothing holds any more.
    /// O(kept frames) for a new one; one a patch's new reference.
    pub fn keep(&mut self, sigs: &[u32; 8], f: FrameId) {
        let groups = self.det.cfg.groups as usize;
        match self.kept_at(f) {
            Ok(i) => self.kept[i + 1..i + 1 + groups].copy_from_slice(&sigs[..groups]),
            Err(i) => {
                let entry = std::iter::once(f.0).chain(sigs[..groups].iter().copied());
                self.kept.splice(i..i, entry);
            }
        }
    }

    /// Where frame `f`'s entry is in [`Self::kept`] (`Ok`), or would go (`Err`): word
    /// offsets.
    fn kept_at(&self, f: FrameId) -> Result<usize, usize> {
        let stride = 1 + self.det.cfg.groups as usize;
        let (mut lo, mut hi) = (0, self.kept.len() / stride);
        while lo < hi {
            let mid = (lo + hi) / 2;
            match self.kept[mid * stride].cmp(&f.0) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Ok(mid * stride),
            }
        }
        Err(lo * stride)
    }

    /// Frames kept ([`Self::keep`]), in frame order.
    fn kept_frames(&self) -> impl Iterator<Item = FrameId> + '_ {
        let stride = 1 + self.det.cfg.groups as usize;
        self.kept.iter().step_by(stride).map(|&f| FrameId(f))
    }

    /// Frame `f`'s kept signatures (`groups` of them), if it is kept. O(log kept).
    pub fn kept_signatures(&self, f: FrameId) -> Option<&[u32]> {
        let groups = self.det.cfg.groups as usize;
        let i = self.kept_at(f).ok()?;
        Some(&self.kept[i + 1..i + 1 + groups])
    }

    /// Forgets frame `f` (freed, or withdrawn from sharing): its kept entry, and its
    /// slots in the buckets of its kept signatures (the only ones a frame is indexed
    /// under: frames enter the index as kept references alone). The pool hands freed ids
    /// out again (`FrameTable::alloc`, once its never-used ids run out), so without this
    /// a frame holding other bytes under a freed reference's id would be indexed under
    /// the old signatures at every clear while anything holds it; and until the next
    /// clear a withdrawn reference (never-share) would keep its buckets (c = 1) from
    /// pages that could be references. O(kept frames).
    pub fn forget_frame(&mut self, f: FrameId) {
        let groups = self.det.cfg.groups as usize;
        let Ok(i) = self.kept_at(f) else {
            return;
        };
        let mut sigs = [0u32; 8];
        sigs[..groups].copy_from_slice(&self.kept[i + 1..i + 1 + groups]);
        self.kept.drain(i..i + 1 + groups);
        self.evict(&sigs, RefPage::Frame(f));
    }

    /// Empties `c`'s slots in the buckets of `sigs`: a candidate found to be no reference
    /// any more (DE §4.3's index holds candidates for a cycle; one that was shared or
    /// stored since would hold its bucket till the next clear).
    pub fn evict(&mut self, sigs: &[u32; 8], c: RefPage) {
        if self.slots.is_empty() {
            return;
        }
        let packed = c.pack();
        for (g, &sig) in sigs.iter().enumerate().take(self.det.cfg.groups as usize) {
            let r = self.bucket(g, sig);
            if let Some(slot) = self.slots[r].iter_mut().find(|s| **s == packed) {
                *slot = EMPTY;
                self.len -= 1;
            }
        }
    }

    /// Empties every slot of a guest page at a gpn in `gpns` (a guest that left: its
    /// page space is handed to the next guest attached, maybe of another domain).
    /// Returns how many slots were emptied. O(slots).
    pub fn forget_guest_pages(&mut self, gpns: std::ops::Range<u32>) -> usize {
        let mut n = 0;
        for s in self.slots.iter_mut() {
            if *s != EMPTY
                && matches!(RefPage::unpack(*s), RefPage::Guest(Gpn(g)) if gpns.contains(&g))
            {
                *s = EMPTY;
                n += 1;
            }
        }
        self.len -= n;
        n
    }

    /// The guest pages indexed, once a slot each (for invariant checks).
    pub fn guest_candidates(&self) -> impl Iterator<Item = Gpn> + '_ {
        self.slots
            .iter()
            .filter(|&&s| s != EMPTY)
            .filter_map(|&s| match RefPage::unpack(s) {
                RefPage::Guest(g) => Some(g),
                RefPage::Frame(_) => None,
            })
    }

    /// Keeps only the kept frames `still` says yes to, and gives back the room left.
    /// O(kept frames); the engine calls it before each clear.
    pub fn retain_kept(&mut self, mut still: impl FnMut(FrameId) -> bool) {
        let stride = 1 + self.det.cfg.groups as usize;
        let mut at = 0;
        for i in (0..self.kept.len()).step_by(stride) {
            if still(FrameId(self.kept[i])) {
                self.kept.copy_within(i..i + stride, at);
                at += stride;
            }
        }
        self.kept.truncate(at);
        self.kept.shrink_to(at + at / 8);
    }

    /// Frames kept across clears ([`Self::keep`]).
    pub fn kept(&self) -> usize {
        self.kept.len() / (1 + self.det.cfg.groups as usize)
    }

    /// Pages offered to [`Self::insert`] since the last clear: a page already indexed
    /// counts once, one every bucket refused (or whose content changed) each time.
    pub fn offered(&self) -> usize {
        self.offered
    }

    /// Whether [`Self::clear_for`]`(n)` would give a larger table than the current one.
    pub fn would_grow(&self, n: u64) -> bool {
        self.table_bits_for(n) > self.table_bits
    }

    /// The table bits [`Self::clear_for`]`(n)` sizes the table with.
    fn table_bits_for(&self, n: u64) -> u8 {
        let want = (64 - (n.max(2) - 1).leading_zeros()) as u8; // ⌈log2(n)⌉
                                                                // Never wider than the hash: `clamp` would panic for a hash narrower than the floor.
        want.saturating_sub(1)
            .max(MIN_TABLE_BITS)
            .min(self.det.cfg.hash_bits)
    }

    /// Clears so far ([`Self::clear_for`]): 0 for an index never sized.
    pub fn cycles(&self) -> u64 {
        self.cycles
    }

    /// Candidates held, summed over groups.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if no candidate is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Buckets per group (2^table_bits).
    pub fn buckets(&self) -> usize {
        1 << self.table_bits
    }

    /// Bytes of memory the table occupies.
    pub fn metadata_bytes(&self) -> usize {
        (self.slots.capacity() + self.kept.capacity()) * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn similar_pages_share_a_signature_and_unrelated_ones_do_not() {
        let det = SimilarityDetector::new(SimilarityConfig::default()).unwrap();
        let mut a = [0u8; PAGE_SIZE];
        for (i, b) in a.iter_mut().enumerate() {
            *b = (i * 31 % 251) as u8;
        }
        let mut b = a;
        // Change one block that is not indexed: all signatures still match.
        let free_block = (0..64u8).find(|x| !det.blocks.contains(x)).unwrap() as usize;
        b[free_block * BLOCK] ^= 0xFF;
        assert_eq!(det.signatures(&a)[..2], det.signatures(&b)[..2]);
        // Change the first indexed block: one signature differs, the other still matches.
        let mut c = a;
        c[det.blocks[0] as usize * BLOCK] ^= 1;
        let (sa, sc) = (det.signatures(&a), det.signatures(&c));
        assert_ne!(sa[0], sc[0]);
        assert_eq!(sa[1], sc[1]);

        let mut idx = SimilarityIndex::new(det.clone());
        let one = RefPage::Guest(Gpn(1));
        assert_eq!(idx.insert(&sa, one), 2);
        assert_eq!(idx.insert(&sa, one), 0, "no duplicate of the same page");
        assert_eq!(
            idx.insert(&sa, RefPage::Frame(FrameId(1))),
            0,
            "c = 1: first candidate kept"
        );
        let mut out = Vec::new();
        idx.candidates(&sc, &mut out);
        assert_eq!(out, vec![one]);
        // The page promoted to a reference frame: the frame takes its slots.
        let frame = RefPage::Frame(FrameId(1));
        let offered = idx.offered();
        assert_eq!(idx.replace(&sa, one, frame), 2);
        assert_eq!((idx.len(), idx.offered()), (2, offered));
        idx.candidates(&sc, &mut out);
        assert_eq!(out, vec![frame]);
        assert_eq!(idx.replace(&sa, one, frame), 2, "held already");
        assert_eq!(idx.len(), 2);
        assert!(idx.matches(&sc, &a));
        let mut unrelated = [0u8; PAGE_SIZE];
        unrelated[0] = 1;
        assert!(!idx.matches(&sc, &unrelated));
        idx.clear_for(1 << 20);
        assert_eq!(idx.buckets(), 1 << 19, "half the managed pages");
        idx.candidates(&sa, &mut out);
        assert!(out.is_empty());
        assert!(!idx.would_grow(1 << 20) && !idx.would_grow(1 << 10));
        assert!(
            idx.would_grow(1 << 21),
            "a larger table for twice the pages"
        );
        idx.clear_for(100);
        assert_eq!(idx.buckets(), 1 << MIN_TABLE_BITS);
    }

    /// A freed frame leaves the index at once: its kept entry and its bucket slots, so
    /// its id, handed out again for other bytes, is no candidate under the old
    /// signatures — before the next clear or after it.
    #[test]
    fn a_forgotten_frame_is_no_candidate_and_is_not_indexed_again() {
        let det = SimilarityDetector::new(SimilarityConfig::default()).unwrap();
        let mut idx = SimilarityIndex::new(det.clone());
        idx.clear_for(1 << 12);
        let mut a = [0u8; PAGE_SIZE];
        for (i, x) in a.iter_mut().enumerate() {
            *x = (i * 31 % 251) as u8;
        }
        let sa = det.signatures(&a);
        let (f, other) = (FrameId(3), FrameId(4));
        idx.insert(&sa, RefPage::Frame(f));
        idx.keep(&sa, f);
        idx.keep(&sa, other);
        let len = idx.len();
        let mut out = Vec::new();
        idx.candidates(&sa, &mut out);
        assert_eq!(out, vec![RefPage::Frame(f)]);
        idx.forget_frame(f);
        idx.forget_frame(FrameId(9));
        assert_eq!((idx.kept(), idx.kept_signatures(f)), (1, None));
        assert!(idx.len() < len);
        idx.candidates(&sa, &mut out);
        assert!(out.is_empty(), "{out:?}");
        idx.clear_for(1 << 12);
        idx.candidates(&sa, &mut out);
        assert_eq!(
            out,
            vec![RefPage::Frame(other)],
            "only the frame still kept"
        );
    }

    /// Kept frames are indexed again after every clear until `retain_kept` drops them;
    /// a frame kept twice is indexed under its latest signatures only; a frame kept
    /// between two others is found; the room of a dropped one is given back.
    #[test]
    fn kept_frames_outlive_a_clear_under_their_latest_signatures() {
        let det = SimilarityDetector::new(SimilarityConfig::default()).unwrap();
        let mut idx = SimilarityIndex::new(det.clone());
        let (mut a, mut b) = ([0u8; PAGE_SIZE], [0u8; PAGE_SIZE]);
        for (i, (x, y)) in a.iter_mut().zip(b.iter_mut()).enumerate() {
            (*x, *y) = ((i * 31 % 251) as u8, (i * 17 % 241) as u8);
        }
        let (sa, sb) = (det.signatures(&a), det.signatures(&b));
        let (f1, f2) = (FrameId(1), FrameId(200));
        idx.keep(&sa, f1);
        idx.keep(&sa, f2);
        idx.keep(&sb, f1);
        assert_eq!(idx.kept(), 2, "f1 once, under sb");
        assert_eq!(idx.kept_signatures(f1), Some(&sb[..2]));
        assert_eq!(idx.kept_signatures(FrameId(2)), None);
        idx.keep(&sb, FrameId(50));
        assert_eq!(idx.kept_signatures(FrameId(50)), Some(&sb[..2]));
        assert_eq!(idx.kept_signatures(f2), Some(&sa[..2]));
        idx.retain_kept(|f| f != FrameId(50));
        idx.clear_for(1 << 12);
        let mut out = Vec::new();
        idx.candidates(&sb, &mut out);
        assert_eq!(out, vec![RefPage::Frame(f1)], "kept across the clear");
        idx.candidates(&sa, &mut out);
        assert_eq!(
            out,
            vec![RefPage::Frame(f2)],
            "f1's old signatures are gone"
        );
        assert_eq!(idx.offered(), 2, "re-indexed frames count as offered");
        let held = idx.metadata_bytes();
        idx.retain_kept(|f| f != f2);
        assert_eq!((idx.kept(), idx.kept_signatures(f2)), (1, None));
        assert!(
            idx.metadata_bytes() < held,
            "the dropped frame's room given back"
        );
        idx.clear_for(1 << 12);
        idx.candidates(&sa, &mut out);
        assert!(out.is_empty(), "{out:?}: f2 dropped");
        idx.candidates(&sb, &mut out);
        assert_eq!(out, vec![RefPage::Frame(f1)]);
    }

    #[test]
    fn hash_bits_and_parameters_are_checked() {
        let det = SimilarityDetector::new(SimilarityConfig {
            hash_bits: 18,
            ..Default::default()
        })
        .unwrap();
        let page = [7u8; PAGE_SIZE];
        assert!(det.signatures(&page).iter().all(|&s| s < 1 << 18));
        let mut idx = SimilarityIndex::new(det);
        idx.clear_for(1 << 30);
        assert_eq!(idx.buckets(), 1 << 18, "never wider than the hash");
        assert!(
            !idx.would_grow(1 << 40),
            "at the hash's width it cannot grow"
        );
        for hash_bits in [8, 9] {
            let det = SimilarityDetector::new(SimilarityConfig {
                hash_bits,
                ..Default::default()
            })
            .unwrap();
            let mut idx = SimilarityIndex::new(det);
            assert_eq!(
                idx.buckets(),
                1 << hash_bits,
                "a new index, {hash_bits} bits"
            );
            assert!(!idx.would_grow(1 << 30), "{hash_bits} bits cannot grow");
            idx.clear_for(1 << 20);
            assert_eq!(idx.buckets(), 1 << hash_bits, "sized, {hash_bits} bits");
        }
        assert!(SimilarityDetector::new(SimilarityConfig {
            groups: 0,
            ..Default::default()
        })
        .is_err());
        assert!(SimilarityDetector::new(SimilarityConfig {
            hash_bits: 33,
            ..Default::default()
        })
        .is_err());
        let det = SimilarityDetector::new(SimilarityConfig {
            groups: 8,
            blocks_per_group: 8,
            ..Default::default()
        })
        .unwrap();
        let mut sorted = det.blocks.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 64, "distinct block offsets");
    }
}
