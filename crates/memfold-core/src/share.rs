//! The content-hash table of shared and hint entries (ESX §4.3; DE §3.1, §4.3).

use hashbrown::HashTable;

use crate::ids::{FrameId, Gpn};

/// One entry of the share table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShareEntry {
    /// A frame shared copy-on-write whose content hashes to the entry's hash (ESX "shared frame").
    Shared(FrameId),
    /// A page hashed once and not yet shared (ESX "hint frame"). Its content may have
    /// changed since: a hint is only a candidate, confirmed byte for byte before sharing.
    Hint(Gpn),
}

/// Hash table from 64-bit page content hashes to shared frames and hints.
///
/// Each entry is one `u64`: the upper 32 bits of the content hash and a 32-bit payload
/// (top bit: hint, else shared frame). Entries with the same upper hash bits chain in the
/// table; every match is confirmed byte for byte by the caller, so a hash collision can
/// never share different pages. Chains are bounded ([`Self::MAX_CHAIN`]): a page whose hash
/// chain is full is ineligible, as ESX treats a page with a false match.
///
/// With partitioning (DE §4.3, after Kloster et al.: memory processed in `passes` hash
/// intervals), the caller hints a quiet page only in the full scans whose interval holds
/// its hash ([`Self::in_current_pass`]), so the hints of quiet pages take about
/// 1/`passes` of the room. Unlike DE, shared entries stay across passes: they are one a
/// frame (few), and a page equal to a frame is shared in whichever scan reads it.
pub struct ShareTable {
    table: HashTable<u64>,
    passes: u32,
    pass: u32,
}

const HINT_BIT: u32 = 1 << 31;

#[inline]
fn table_hash(tag: u32) -> u64 {
    // The tag is already uniformly distributed (a slice of xxh3); spread it over 64 bits.
    (tag as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The table hash of a stored entry (its tag is its upper 32 bits, as a content hash's
/// is: [`tag_of`]), for hashbrown's rehashing.
#[inline]
fn entry_hash(v: &u64) -> u64 {
    table_hash(tag_of(*v))
}

#[inline]
fn tag_of(hash: u64) -> u32 {
    (hash >> 32) as u32
}

#[inline]
fn pack(hash: u64, e: ShareEntry) -> u64 {
    let payload = match e {
        ShareEntry::Shared(f) => f.0,
        ShareEntry::Hint(g) => {
            debug_assert!(g.0 < HINT_BIT);
            g.0 | HINT_BIT
        }
    };
    (tag_of(hash) as u64) << 32 | payload as u64
}

#[inline]
fn unpack(v: u64) -> ShareEntry {
    let p = v as u32;
    if p & HINT_BIT != 0 {
        ShareEntry::Hint(Gpn(p & !HINT_BIT))
    } else {
        ShareEntry::Shared(FrameId(p))
    }
}

impl ShareTable {
    /// Longest chain of entries with the same 32-bit hash tag.
    pub const MAX_CHAIN: usize = 8;

    /// A table processing quiet pages' hints in `passes` hash intervals, one a full scan
    /// (1 = no partitioning; DE used 5). Odd `passes` (the engine checks it) cycle
    /// through every interval within the scans where the scan reads every page
    /// (multiples of 8, `engine::scan`), so any two quiet duplicates meet.
    pub fn new(passes: u32) -> Self {
        ShareTable {
            table: HashTable::new(),
            passes: passes.max(1),
            pass: 0,
        }
    }

    /// Whether a content hash falls in the current pass's interval: a quiet page with it
    /// is hinted in this pass (every page is looked up in every pass).
    pub fn in_current_pass(&self, hash: u64) -> bool {
        self.passes == 1 || ((tag_of(hash) as u64 * self.passes as u64) >> 32) as u32 == self.pass
    }

    /// The entries whose hash tag equals `hash`'s, at most [`Self::MAX_CHAIN`].
    pub fn lookup(&self, hash: u64) -> impl Iterator<Item = ShareEntry> + '_ {
        let tag = tag_of(hash);
        self.table
            .iter_hash(table_hash(tag))
            .filter(move |&&v| (v >> 32) as u32 == tag)
            .map(|&v| unpack(v))
    }

    /// Inserts an entry. Returns false (and inserts nothing) if the chain for this hash is full.
    pub fn insert(&mut self, hash: u64, e: ShareEntry) -> bool {
        if self.lookup(hash).count() >= Self::MAX_CHAIN {
            return false;
        }
        self.table
            .insert_unique(table_hash(tag_of(hash)), pack(hash, e), entry_hash);
        true
    }

    /// Removes one entry equal to `e` under `hash`; returns whether it was there.
    pub fn remove(&mut self, hash: u64, e: ShareEntry) -> bool {
        let v = pack(hash, e);
        match self.table.find_entry(table_hash(tag_of(hash)), |&x| x == v) {
            Ok(entry) => {
                entry.remove();
                true
            }
            Err(_) => false,
        }
    }

    /// Replaces entry `old` by `new` under the same hash; returns whether `old` was there.
    pub fn replace(&mut self, hash: u64, old: ShareEntry, new: ShareEntry) -> bool {
        let v = pack(hash, old);
        match self.table.find_mut(table_hash(tag_of(hash)), |&x| x == v) {
            Some(slot) => {
                *slot = pack(hash, new);
                true
            }
            None => false,
        }
    }

    /// Ends a pass (a full scan): drops every hint, keeps the shared entries, and moves
    /// to the next hash interval.
    ///
    /// The table then shrinks to what is left (issue 19, metadata). The first full scans
    /// hint nearly every private page; later ones hint only the pages they read, and the
    /// scan reads quiet pages seldom, so a table kept at its first size held up to ten
    /// times the buckets its entries needed (131 072 buckets for 9 936–13 415 entries
    /// through a 240 s db + py run, docs/metadata.md). The next scan grows it again as
    /// it hints; the rehash is one pass over the entries left, once a full scan.
    pub fn end_pass(&mut self) {
        self.table
            .retain(|v| matches!(unpack(*v), ShareEntry::Shared(_)));
        self.table.shrink_to(0, entry_hash);
        self.pass = (self.pass + 1) % self.passes;
    }

    /// Drops every hint at a gpn in `gpns` (a guest that left: its page space is handed
    /// to the next guest attached, maybe of another domain). Returns how many were
    /// dropped. O(entries).
    pub fn forget_hints(&mut self, gpns: std::ops::Range<u32>) -> usize {
        let before = self.table.len();
        self.table
            .retain(|v| !matches!(unpack(*v), ShareEntry::Hint(Gpn(g)) if gpns.contains(&g)));
        before - self.table.len()
    }

    /// Hash intervals per cycle.
    pub fn passes(&self) -> u32 {
        self.passes
    }

    /// Current pass within the cycle, `0..passes`.
    pub fn pass(&self) -> u32 {
        self.pass
    }

    /// Entries held (shared + hints).
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// True if the table holds no entry.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// All entries (for invariant checks).
    pub fn entries(&self) -> impl Iterator<Item = (u32, ShareEntry)> + '_ {
        self.table.iter().map(|&v| ((v >> 32) as u32, unpack(v)))
    }

    /// Bytes of memory the table occupies (buckets of 8 bytes plus one control byte).
    pub fn metadata_bytes(&self) -> usize {
        hashbrown_bytes(self.table.capacity(), 8)
    }
}

/// Approximate heap bytes of a hashbrown table with `capacity` usable slots of `entry`
/// bytes: buckets are a power of two at most 7/8 full, plus one control byte each.
pub(crate) fn hashbrown_bytes(capacity: usize, entry: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (entry + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_chain() {
        let mut t = ShareTable::new(1);
        let h = 0xdead_beef_0000_0001;
        assert!(t.insert(h, ShareEntry::Hint(Gpn(7))));
        assert!(t.insert(h, ShareEntry::Shared(FrameId(3))));
        let got: Vec<_> = t.lookup(h).collect();
        assert_eq!(got.len(), 2);
        assert!(
            got.contains(&ShareEntry::Hint(Gpn(7)))
                && got.contains(&ShareEntry::Shared(FrameId(3)))
        );
        assert!(t.replace(h, ShareEntry::Hint(Gpn(7)), ShareEntry::Shared(FrameId(9))));
        assert!(t.remove(h, ShareEntry::Shared(FrameId(3))));
        assert_eq!(
            t.lookup(h).collect::<Vec<_>>(),
            vec![ShareEntry::Shared(FrameId(9))]
        );
        for i in 0..ShareTable::MAX_CHAIN as u32 - 1 {
            assert!(t.insert(h, ShareEntry::Hint(Gpn(100 + i))));
        }
        assert!(!t.insert(h, ShareEntry::Hint(Gpn(999))), "chain bound");
        // End of pass keeps shared entries, drops hints.
        t.end_pass();
        assert_eq!(t.len(), 1);
    }

    /// A full scan's hints go with their buckets: after the pass ends the table is sized
    /// for the shared entries left, not for the hints it held (issue 19). Without the
    /// shrink it kept the 16 384 buckets of its 10 000 hints.
    #[test]
    fn ending_a_pass_gives_back_the_buckets_of_its_hints() {
        let mut t = ShareTable::new(1);
        let h = |i: u64| i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for i in 0..10_000u32 {
            assert!(t.insert(h(i as u64), ShareEntry::Hint(Gpn(i))));
        }
        for i in 0..100u32 {
            assert!(t.insert(h(1_000_000 + i as u64), ShareEntry::Shared(FrameId(i))));
        }
        let full = t.metadata_bytes();
        assert!(full >= 16_384 * 9, "{full}");
        t.end_pass();
        assert_eq!(t.len(), 100);
        assert_eq!(t.metadata_bytes(), hashbrown_bytes(100, 8));
        assert!(t.metadata_bytes() * 50 < full);
        // The shared entries are still found, and the table grows again for new hints.
        for i in 0..100u32 {
            let e = ShareEntry::Shared(FrameId(i));
            assert!(t.lookup(h(1_000_000 + i as u64)).any(|x| x == e));
        }
        for i in 0..5_000u32 {
            assert!(t.insert(h(i as u64), ShareEntry::Hint(Gpn(i))));
        }
        assert_eq!(t.len(), 5_100);
    }

    #[test]
    fn partitioning_covers_every_hash_exactly_once_per_cycle() {
        let mut t = ShareTable::new(5);
        let hashes: Vec<u64> = (0..1000u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let mut seen = vec![0; hashes.len()];
        for _ in 0..5 {
            for (i, &h) in hashes.iter().enumerate() {
                if t.in_current_pass(h) {
                    seen[i] += 1;
                }
            }
            t.end_pass();
        }
        assert!(seen.iter().all(|&n| n == 1));
        assert_eq!(t.pass(), 0, "the cycle is over");
    }

    /// A shared entry outlives the pass it was made in, with partitioning too: a page
    /// equal to a frame is shared in any scan, not only its interval's.
    #[test]
    fn shared_entries_outlive_every_pass_hints_do_not() {
        let mut t = ShareTable::new(5);
        let h = 0x1234_5678_9abc_def0;
        assert!(t.insert(h, ShareEntry::Shared(FrameId(4))));
        assert!(t.insert(h ^ (1 << 40), ShareEntry::Hint(Gpn(9))));
        for _ in 0..7 {
            t.end_pass();
            assert_eq!(
                t.lookup(h).collect::<Vec<_>>(),
                [ShareEntry::Shared(FrameId(4))]
            );
        }
        assert_eq!(t.len(), 1);
    }
}
