//! Slot allocation for blobs whose bytes live outside the engine's frames: the live
//! daemon's store file of patches and compressed pages (Difference Engine §4.1's "custom
//! block allocator").
//!
//! No data and no headers: the store is a file of 4 KiB chunks, each chunk holding equal slots of one class, and
//! the caller keeps each blob's description. [`Slab::alloc`] says where to write a blob
//! (a byte offset in the file); [`Slab::free`] says when a chunk has emptied, so the
//! caller can punch it out of the file and give the memory back.

use serde::Serialize;

use crate::ids::SlotId;
use crate::PAGE_SIZE;

/// Slots per chunk of each size class; a class's slot size is `4096 / slots` rounded down
/// to 8 bytes. Consecutive classes differ by at most ~33%, which bounds internal waste.
const SLOTS_PER_CHUNK: [u8; 15] = [64, 48, 32, 24, 16, 12, 10, 8, 7, 6, 5, 4, 3, 2, 1];

/// Number of slot size classes.
pub const CLASSES: usize = SLOTS_PER_CHUNK.len();

fn class_slots(class: usize) -> u32 {
    SLOTS_PER_CHUNK[class] as u32
}

fn class_size(class: usize) -> usize {
    (PAGE_SIZE / SLOTS_PER_CHUNK[class] as usize) & !7
}

fn class_fitting(bytes: usize) -> usize {
    (0..CLASSES)
        .find(|&c| class_size(c) >= bytes.max(1))
        .expect("a class fits any blob up to a page")
}

/// The slot size, bytes, a blob of `len` bytes (1..=4096) occupies.
pub fn slot_size(len: usize) -> usize {
    class_size(class_fitting(len))
}

/// A slot id is `chunk << 6 | slot` (at most 64 slots a chunk).
const SLOT_BITS: u32 = 6;

#[derive(Clone, Copy, Default)]
struct Chunk {
    class: u8,
    used: u64,
}

/// A slot handed out by [`Slab::alloc`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Id to free it with.
    pub id: SlotId,
    /// Byte offset in the store file.
    pub offset: u64,
    /// Slot size, bytes (at least the blob's length).
    pub size: u32,
}

/// Occupancy of a [`Slab`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SlabStats {
    /// Live slots.
    pub slots: u64,
    /// Chunks (4 KiB pages of the store file) holding a live slot.
    pub chunks: u64,
    /// Sum of the live slots' sizes, bytes.
    pub slot_bytes: u64,
}

/// A size-class slab allocator over a file of 4 KiB chunks.
#[derive(Default)]
pub struct Slab {
    chunks: Vec<Chunk>,
    free_chunks: Vec<u32>,
    /// Per class, chunks with a free slot (most recently freed last).
    partial: [Vec<u32>; CLASSES],
    stats: SlabStats,
}

impl Slab {
    /// An empty slab.
    pub fn new() -> Self {
        Self::default()
    }

    /// A slot for a blob of `len` bytes (1..=[`PAGE_SIZE`]); `None` for another length or
    /// when the slot id space (2^26 chunks, 256 GiB) is exhausted. Reuses free slots
    /// of the class before opening a chunk, and the lowest free chunk number first.
    pub fn alloc(&mut self, len: usize) -> Option<Slot> {
        if len == 0 || len > PAGE_SIZE {
            return None;
        }
        let class = class_fitting(len);
        let ci = match self.partial[class].last() {
            Some(&c) => c,
            None => {
                let ci = match self.free_chunks.pop() {
                    Some(ci) => ci,
                    None if self.chunks.len() < 1 << (32 - SLOT_BITS) => {
                        self.chunks.push(Chunk::default());
                        self.chunks.len() as u32 - 1
                    }
                    None => return None,
                };
                self.chunks[ci as usize] = Chunk {
                    class: class as u8,
                    used: 0,
                };
                self.partial[class].push(ci);
                self.stats.chunks += 1;
                ci
            }
        };
        let chunk = &mut self.chunks[ci as usize];
        let slot = (!chunk.used).trailing_zeros();
        chunk.used |= 1 << slot;
        if chunk.used.count_ones() == class_slots(class) {
            self.partial[class].pop();
        }
        let size = class_size(class);
        self.stats.slots += 1;
        self.stats.slot_bytes += size as u64;
        Some(Slot {
            id: SlotId(ci << SLOT_BITS | slot),
            offset: ci as u64 * PAGE_SIZE as u64 + slot as u64 * size as u64,
            size: size as u32,
        })
    }

    /// Frees slot `id`. Returns the byte offset of its chunk if the chunk is now empty
    /// (the caller may punch that page out of the file). Panics on an id that is not live
    /// (a caller bug: a double free would hand one slot to two blobs).
    pub fn free(&mut self, id: SlotId) -> Option<u64> {
        let id = id.0;
        let ci = id >> SLOT_BITS;
        let bit = 1u64 << (id & ((1 << SLOT_BITS) - 1));
        let chunk = &mut self.chunks[ci as usize];
        assert!(chunk.used & bit != 0, "slot {id} is not live");
        let class = chunk.class as usize;
        let was_full = chunk.used.count_ones() == class_slots(class);
        chunk.used &= !bit;
        self.stats.slots -= 1;
        self.stats.slot_bytes -= class_size(class) as u64;
        if chunk.used == 0 {
            if let Some(pos) = self.partial[class].iter().rposition(|&c| c == ci) {
                self.partial[class].swap_remove(pos);
            }
            self.free_chunks.push(ci);
            // Lowest numbers first keeps the file's used part dense.
            self.free_chunks.sort_unstable_by(|a, b| b.cmp(a));
            self.stats.chunks -= 1;
            return Some(ci as u64 * PAGE_SIZE as u64);
        }
        if was_full {
            self.partial[class].push(ci);
        }
        None
    }

    /// Occupancy.
    pub fn stats(&self) -> SlabStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::SmallRng, Rng, SeedableRng};

    #[test]
    fn packs_by_class_and_empties_chunks() {
        let mut s = Slab::new();
        let a: Vec<Slot> = (0..65).map(|_| s.alloc(60).unwrap()).collect();
        assert_eq!(a[0].size, 64);
        assert_eq!(s.stats().chunks, 2, "64 slots of 64 bytes a chunk");
        assert_eq!(a[64].offset, 4096);
        let big = s.alloc(3000).unwrap();
        assert_eq!((big.size, big.offset), (4096, 8192));
        assert_eq!(s.free(big.id), Some(8192));
        assert_eq!(s.free(a[64].id), Some(4096));
        assert_eq!(s.free(a[3].id), None);
        assert_eq!(
            s.alloc(10).unwrap().offset,
            3 * 64,
            "a freed slot is reused"
        );
        assert!(s.alloc(0).is_none() && s.alloc(4097).is_none());
    }

    #[test]
    #[should_panic(expected = "not live")]
    fn double_free_panics() {
        let mut s = Slab::new();
        let a = s.alloc(100).unwrap();
        s.free(a.id);
        s.free(a.id);
    }

    /// Random allocs and frees never hand out overlapping live slots, and the books add up.
    #[test]
    fn live_slots_never_overlap() {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut s = Slab::new();
        let mut live: Vec<(Slot, usize)> = Vec::new();
        for _ in 0..20_000 {
            if live.is_empty() || rng.gen_bool(0.55) {
                let len = rng.gen_range(1..=PAGE_SIZE);
                let slot = s.alloc(len).unwrap();
                assert!(slot.size as usize >= len);
                live.push((slot, len));
            } else {
                let (slot, _) = live.swap_remove(rng.gen_range(0..live.len()));
                s.free(slot.id);
            }
        }
        let mut spans: Vec<(u64, u64)> = live
            .iter()
            .map(|(sl, _)| (sl.offset, sl.offset + sl.size as u64))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "overlap {w:?}");
        }
        for &(a, b) in &spans {
            assert_eq!(a / 4096, (b - 1) / 4096, "a slot stays inside its chunk");
        }
        let st = s.stats();
        assert_eq!(st.slots, live.len() as u64);
        assert_eq!(
            st.slot_bytes,
            live.iter().map(|(sl, _)| sl.size as u64).sum::<u64>()
        );
        let chunks: std::collections::BTreeSet<u64> = spans.iter().map(|s| s.0 / 4096).collect();
        assert_eq!(st.chunks, chunks.len() as u64);
    }
}
