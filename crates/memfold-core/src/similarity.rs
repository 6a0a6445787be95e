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
}

const EMPTY: u32 = u32::MAX;
const MIN_TABLE_BITS: u8 = 10;

impl SimilarityIndex {
    /// An empty index for this detector, with the smallest table.
    pub fn new(det: SimilarityDetector) -> Self {
        SimilarityIndex {
            det,
            slots: Vec::new(),
            table_bits: MIN_TABLE_BITS,
            len: 0,
            offered: 0,
            cycles: 0,
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
    /// most 2^hash_bits). DE's `n` is the managed guest pages.
    pub fn clear_for(&mut self, n: u64) {
        self.table_bits = self.table_bits_for(n);
        self.slots = Vec::new();
        self.len = 0;
        self.offered = 0;
        self.cycles += 1;
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
        want.saturating_sub(1)
            .clamp(MIN_TABLE_BITS, self.det.cfg.hash_bits)
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
        self.slots.capacity() * 4
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
