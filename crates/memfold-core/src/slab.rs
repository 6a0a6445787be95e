//! Slot allocation for blobs whose bytes live outside the engine's frames: the live
//! daemon's store file of patches and compressed pages (Difference Engine §4.1's "custom
//! block allocator").
//!
//! No data and no headers: the store is a file of chunks — runs of 1 to
//! [`MAX_CHUNK_PAGES`] consecutive 4 KiB pages — each holding equal slots of one size
//! class, as zsmalloc's zspages do. Multi-page chunks let a blob of 2–4 KiB take little
//! more than its length (a 3 000-byte blob takes a 3 072-byte slot, 4 of them in 3 pages)
//! instead of a whole page, so compression saves memory on every page that compresses at
//! all, as zswap does. A slot may straddle a page boundary inside its chunk; blobs are read
//! and written by offset, never mapped. [`Slab::alloc`] says where to write a blob (a byte
//! offset in the file); [`Slab::free`] says when a chunk has emptied, so the caller can
//! punch its pages out of the file and give the memory back.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::ids::SlotId;
use crate::PAGE_SIZE;

/// Each size class: (slots, pages) — `slots` equal slots in a chunk of `pages` pages, a
/// slot's size being `pages × 4096 / slots` rounded down to 8 bytes. Sorted by slot size;
/// consecutive classes differ by at most ~33% under 2 KiB and ~17% above (where every
/// byte of waste is a byte a compressed page fails to save).
const CLASS_SHAPES: [(u8, u8); 28] = [
    (64, 1),  // 64
    (48, 1),  // 80
    (32, 1),  // 128
    (24, 1),  // 168
    (16, 1),  // 256
    (12, 1),  // 336
    (10, 1),  // 408
    (8, 1),   // 512
    (7, 1),   // 584
    (6, 1),   // 680
    (5, 1),   // 816
    (4, 1),   // 1024
    (7, 2),   // 1168
    (3, 1),   // 1360
    (5, 2),   // 1632
    (2, 1),   // 2048
    (7, 4),   // 2336
    (3, 2),   // 2728
    (4, 3),   // 3072
    (5, 4),   // 3272
    (6, 5),   // 3408
    (7, 6),   // 3504
    (8, 7),   // 3584
    (9, 8),   // 3640
    (11, 10), // 3720
    (13, 12), // 3776
    (16, 15), // 3840
    (1, 1),   // 4096
];

/// Number of slot size classes.
pub const CLASSES: usize = CLASS_SHAPES.len();

/// The most pages a chunk spans.
pub const MAX_CHUNK_PAGES: u64 = 15;

fn class_slots(class: usize) -> u32 {
    CLASS_SHAPES[class].0 as u32
}

fn class_pages(class: usize) -> u32 {
    CLASS_SHAPES[class].1 as u32
}

fn class_size(class: usize) -> usize {
    (class_pages(class) as usize * PAGE_SIZE / class_slots(class) as usize) & !7
}

fn class_fitting(bytes: usize) -> usize {
    (0..CLASSES)
        .find(|&c| class_size(c) >= bytes.max(1))
        .expect("a class fits any blob up to a page")
}

/// The slot size, bytes, a blob of `len` bytes (0..=4096) occupies: 0 for an empty
/// blob ([`EMPTY`]).
pub fn slot_size(len: usize) -> usize {
    if len == 0 {
        return 0;
    }
    class_size(class_fitting(len))
}

/// A slot id is `chunk << 6 | slot` (at most 64 slots a chunk).
const SLOT_BITS: u32 = 6;

/// The slot of every empty blob: no bytes in the file, offset 0, size 0. Its chunk id
/// (2^26 − 1) is never handed out. An empty blob is a page identical to its patch's
/// reference frame (run-diff encodes it as 0 bytes; a page shared without a mapping,
/// issue 19): before this, it took a 64-byte slot for a 3-byte patch.
pub const EMPTY: SlotId = SlotId(u32::MAX);

#[derive(Clone, Copy, Default)]
struct Chunk {
    class: u8,
    used: u64,
    /// First page of the chunk in the file.
    first_page: u32,
    /// Pages of the chunk a written slot has covered since it opened (bit k: page k): the
    /// file holds these (a write allocates the pages it covers), until the chunk empties
    /// and is punched out whole. A slot reserved and never written covers none
    /// ([`Slab::reserve`]).
    touched: u16,
}

/// A slot handed out by [`Slab::alloc`] or [`Slab::reserve`].
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
    /// Pages of the file the live chunks hold (4 KiB each): those a written slot has
    /// covered since its chunk opened.
    pub pages: u64,
    /// Sum of the live slots' sizes, bytes.
    pub slot_bytes: u64,
}

/// Free runs of pages in the file, lowest first: first page → pages.
#[derive(Default)]
struct PageRuns {
    free: BTreeMap<u32, u32>,
    /// Pages of the file ever handed out (the file's used length, pages).
    end: u32,
}

impl PageRuns {
    /// `n` consecutive pages, the lowest free run that fits first (keeps the file's used
    /// part dense); `None` past 2^32 pages.
    fn take(&mut self, n: u32) -> Option<u32> {
        let found = self
            .free
            .iter()
            .find(|&(_, &len)| len >= n)
            .map(|(&s, &l)| (s, l));
        if let Some((start, len)) = found {
            self.free.remove(&start);
            if len > n {
                self.free.insert(start + n, len - n);
            }
            return Some(start);
        }
        let start = self.end;
        self.end = start.checked_add(n)?;
        Some(start)
    }

    /// Gives back `n` pages from `start`, merging with free neighbours.
    fn give(&mut self, start: u32, n: u32) {
        let (mut start, mut n) = (start, n);
        if let Some((&ps, &pl)) = self.free.range(..start).next_back() {
            debug_assert!(ps + pl <= start, "pages given back twice");
            if ps + pl == start {
                self.free.remove(&ps);
                start = ps;
                n += pl;
            }
        }
        if let Some(nl) = self.free.remove(&(start + n)) {
            n += nl;
        }
        if start + n == self.end {
            self.end = start; // the file's tail needs no record
        } else {
            self.free.insert(start, n);
        }
    }
}

/// A size-class slab allocator over a file of chunks of 4 KiB pages.
#[derive(Default)]
pub struct Slab {
    chunks: Vec<Chunk>,
    free_ids: Vec<u32>,
    pages: PageRuns,
    /// Per class, chunks with a free slot (most recently freed last).
    partial: [Vec<u32>; CLASSES],
    stats: SlabStats,
}

impl Slab {
    /// An empty slab.
    pub fn new() -> Self {
        Self::default()
    }

    /// A slot for a blob of `len` bytes (0..=[`PAGE_SIZE`]; 0: [`EMPTY`], counted in
    /// the slots but taking no bytes); `None` for a longer blob or when the chunk id
    /// space (2^26 − 1 chunks) or the file's page space (2^32 pages, 16 TiB) is
    /// exhausted. Reuses free slots of the class before opening a chunk, and the lowest
    /// free pages of the file first.
    pub fn alloc(&mut self, len: usize) -> Option<Slot> {
        let slot = self.reserve(len)?;
        self.written(slot.id);
        Some(slot)
    }

    /// [`Slab::alloc`] without counting the pages the slot covers as held: for a caller
    /// that writes the slot next and may fail to. Call [`Slab::written`] once its bytes
    /// are in the file, or [`Slab::free`] if they never got there — the pages it would
    /// have been first to reach then stay out of the books, as the file never held them
    /// ([`crate::blobs::BlobSpace::put`]).
    pub fn reserve(&mut self, len: usize) -> Option<Slot> {
        if len > PAGE_SIZE {
            return None;
        }
        if len == 0 {
            self.stats.slots += 1;
            return Some(Slot {
                id: EMPTY,
                offset: 0,
                size: 0,
            });
        }
        let class = class_fitting(len);
        let ci = match self.partial[class].last() {
            Some(&c) => c,
            None => {
                let ci = match self.free_ids.pop() {
                    Some(ci) => ci,
                    // The last chunk id is `EMPTY`'s.
                    None if self.chunks.len() < (1 << (32 - SLOT_BITS)) - 1 => {
                        self.chunks.push(Chunk::default());
                        self.chunks.len() as u32 - 1
                    }
                    None => return None,
                };
                let Some(first_page) = self.pages.take(class_pages(class)) else {
                    self.free_ids.push(ci);
                    return None;
                };
                self.chunks[ci as usize] = Chunk {
                    class: class as u8,
                    used: 0,
                    first_page,
                    touched: 0,
                };
                self.partial[class].push(ci);
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
            offset: chunk.first_page as u64 * PAGE_SIZE as u64 + slot as u64 * size as u64,
            size: size as u32,
        })
    }

    /// Live slot `id`'s bytes are in the file: the pages it covers are held (counted in
    /// [`SlabStats::pages`] until its chunk empties). Nothing for [`EMPTY`]. Panics on a
    /// slot that is not live.
    pub fn written(&mut self, id: SlotId) {
        let covered = self.not_yet_held(id);
        if covered == 0 {
            return; // EMPTY, or every page held already
        }
        let chunk = &mut self.chunks[(id.0 >> SLOT_BITS) as usize];
        self.stats.pages += covered.count_ones() as u64;
        chunk.touched |= covered;
    }

    /// The pages of live slot `id` that no written slot has covered since its chunk
    /// opened, as `(byte offset, bytes)` of each such page in the file: after a failed
    /// write into a reserved slot, what the write may have allocated and nothing else
    /// holds (the caller punches them; [`crate::blobs::BlobSpace::put`]). Empty for
    /// [`EMPTY`]. Panics on a slot that is not live.
    pub fn unheld_pages(&self, id: SlotId) -> Vec<(u64, u64)> {
        let covered = self.not_yet_held(id);
        if covered == 0 {
            return Vec::new();
        }
        let chunk = &self.chunks[(id.0 >> SLOT_BITS) as usize];
        let page = PAGE_SIZE as u64;
        (0..16)
            .filter(|k| covered & (1 << k) != 0)
            .map(|k| ((chunk.first_page as u64 + k) * page, page))
            .collect()
    }

    /// Bit k: page k of live slot `id`'s chunk, which the slot covers and its chunk's
    /// written slots have not (0 for [`EMPTY`]).
    fn not_yet_held(&self, id: SlotId) -> u16 {
        if id == EMPTY {
            return 0;
        }
        let slot = (id.0 & ((1 << SLOT_BITS) - 1)) as usize;
        let chunk = &self.chunks[(id.0 >> SLOT_BITS) as usize];
        assert!(chunk.used & (1 << slot) != 0, "slot {} is not live", id.0);
        let size = class_size(chunk.class as usize);
        let (lo, hi) = (slot * size, (slot + 1) * size);
        let covered = ((1u32 << hi.div_ceil(PAGE_SIZE)) - (1u32 << (lo / PAGE_SIZE))) as u16;
        covered & !chunk.touched
    }

    /// Frees slot `id`. Returns `(byte offset, bytes)` of its chunk if the chunk is now
    /// empty (the caller may punch those pages out of the file). Panics on an id that is
    /// not live (a caller bug: a double free would hand one slot to two blobs).
    pub fn free(&mut self, id: SlotId) -> Option<(u64, u64)> {
        if id == EMPTY {
            assert!(self.stats.slots > 0, "an empty slot freed that is not live");
            self.stats.slots -= 1;
            return None;
        }
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
            let (first, n) = (chunk.first_page, class_pages(class));
            if let Some(pos) = self.partial[class].iter().rposition(|&c| c == ci) {
                self.partial[class].swap_remove(pos);
            }
            self.free_ids.push(ci);
            self.pages.give(first, n);
            self.stats.pages -= chunk.touched.count_ones() as u64;
            let page = PAGE_SIZE as u64;
            return Some((first as u64 * page, n as u64 * page));
        }
        if was_full {
            self.partial[class].push(ci);
        }
        None
    }

    /// Where live slot `id` is (its byte offset in the file) and its size: from its
    /// chunk's first page and class, so a blob's record need not carry them. [`EMPTY`]
    /// is at 0 with size 0. `None` for a slot that is not live.
    pub fn slot(&self, id: SlotId) -> Option<Slot> {
        if id == EMPTY {
            return Some(Slot {
                id,
                offset: 0,
                size: 0,
            });
        }
        let ci = id.0 >> SLOT_BITS;
        let slot = id.0 & ((1 << SLOT_BITS) - 1);
        let chunk = self.chunks.get(ci as usize)?;
        if chunk.used & (1 << slot) == 0 {
            return None;
        }
        let size = class_size(chunk.class as usize);
        Some(Slot {
            id,
            offset: chunk.first_page as u64 * PAGE_SIZE as u64 + slot as u64 * size as u64,
            size: size as u32,
        })
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

    /// A reserved slot's pages count only once written; freed unwritten, it leaves the
    /// books as they were (a failed blob write: `BlobSpace::put`).
    #[test]
    fn an_unwritten_slot_counts_no_page() {
        let mut s = Slab::new();
        let a = s.alloc(3000).unwrap(); // the 3 KiB class, a 3-page chunk: page 0
        let b = s.reserve(3000).unwrap(); // 3072..6144: page 1, new
        assert_eq!(s.stats().pages, 1, "not written yet");
        assert_eq!(s.unheld_pages(b.id), vec![(4096, 4096)]);
        s.free(b.id);
        assert_eq!(s.stats().pages, 1);
        let c = s.reserve(3000).unwrap();
        assert_eq!(c.offset, b.offset);
        s.written(c.id);
        assert_eq!(s.stats().pages, 2);
        assert!(s.unheld_pages(c.id).is_empty());
        s.free(c.id);
        assert_eq!(
            s.stats().pages,
            2,
            "its chunk live: the file still holds its page"
        );
        assert_eq!(s.free(a.id), Some((0, 3 * 4096)));
        assert_eq!(s.stats(), SlabStats::default());
        let e = s.reserve(0).unwrap();
        s.written(e.id);
        assert!(s.unheld_pages(e.id).is_empty());
        assert_eq!((s.stats().slots, s.stats().pages), (1, 0));
        s.free(e.id);
    }

    #[test]
    fn packs_by_class_and_empties_chunks() {
        let mut s = Slab::new();
        let a: Vec<Slot> = (0..65).map(|_| s.alloc(60).unwrap()).collect();
        assert_eq!(a[0].size, 64);
        assert_eq!(s.stats().pages, 2, "64 slots of 64 bytes a chunk");
        assert_eq!(a[64].offset, 4096);
        let big = s.alloc(3000).unwrap();
        assert_eq!((big.size, big.offset), (3072, 8192), "4 slots in 3 pages");
        let next = s.alloc(3001).unwrap();
        assert_eq!(next.offset, 8192 + 3072, "straddles pages 2 and 3");
        assert_eq!(
            s.stats().pages,
            4,
            "the third page of the chunk is not written yet"
        );
        assert_eq!(s.free(next.id), None);
        assert_eq!(s.free(big.id), Some((8192, 3 * 4096)));
        assert_eq!(s.free(a[64].id), Some((4096, 4096)));
        assert_eq!(s.free(a[3].id), None);
        assert_eq!(
            s.alloc(10).unwrap().offset,
            3 * 64,
            "a freed slot is reused"
        );
        assert_eq!(
            s.alloc(4096).unwrap().offset,
            4096,
            "the lowest free pages first"
        );
        assert!(s.alloc(4097).is_none());
    }

    /// An empty blob (a page identical to its reference) takes no bytes and no chunk,
    /// but counts as a live slot until freed.
    #[test]
    fn an_empty_blob_takes_no_bytes() {
        let mut s = Slab::new();
        let before = s.stats();
        let e = s.alloc(0).unwrap();
        assert_eq!((e.id, e.offset, e.size), (EMPTY, 0, 0));
        let e2 = s.alloc(0).unwrap();
        assert_eq!(e2.id, EMPTY);
        let st = s.stats();
        assert_eq!((st.slots, st.pages, st.slot_bytes), (2, 0, 0));
        let a = s.alloc(10).unwrap();
        assert_eq!(a.offset, 0, "the first real slot is not displaced");
        assert_eq!(s.free(e.id), None);
        assert_eq!(s.free(e2.id), None);
        assert_eq!(s.free(a.id), Some((0, 4096)));
        assert_eq!(s.stats(), before);
        assert_eq!(slot_size(0), 0);
    }

    /// Every class's slots fit its chunk, classes grow, and above 2 KiB no step wastes
    /// more than ~17% of a slot.
    #[test]
    fn classes_are_sorted_and_tight() {
        for c in 0..CLASSES {
            assert!(class_size(c) * class_slots(c) as usize <= class_pages(c) as usize * PAGE_SIZE);
            assert!(class_slots(c) <= 64 && class_pages(c) as u64 <= MAX_CHUNK_PAGES);
            if c > 0 {
                assert!(class_size(c) > class_size(c - 1), "class {c}");
                if class_size(c - 1) >= 2048 {
                    assert!(class_size(c) * 100 <= class_size(c - 1) * 117, "class {c}");
                }
            }
        }
        assert_eq!(class_size(CLASSES - 1), PAGE_SIZE);
        assert_eq!(slot_size(3100), 3272);
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
        for (sl, _) in &live {
            assert_eq!(s.slot(sl.id), Some(*sl), "found where it was handed out");
            // The agents keep blob offsets in 8-byte units (`memfold-agent`'s stash
            // records): they refuse any other.
            assert_eq!(sl.offset % 8, 0, "{sl:?}: offset not a multiple of 8");
        }
        let e = Slot {
            id: EMPTY,
            offset: 0,
            size: 0,
        };
        assert_eq!(s.slot(EMPTY), Some(e));
        let mut spans: Vec<(u64, u64)> = live
            .iter()
            .map(|(sl, _)| (sl.offset, sl.offset + sl.size as u64))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "overlap {w:?}");
        }
        // Each slot lies inside its chunk's pages, and no two live chunks share a page.
        let mut chunk_pages = std::collections::BTreeMap::new();
        for (sl, _) in &live {
            let c = s.chunks[(sl.id.0 >> SLOT_BITS) as usize];
            let (lo, n) = (
                c.first_page as u64 * 4096,
                class_pages(c.class as usize) as u64,
            );
            assert!(sl.offset >= lo && sl.offset + sl.size as u64 <= lo + n * 4096);
            chunk_pages.insert(c.first_page, (n, c.touched));
            for p in sl.offset / 4096..(sl.offset + sl.size as u64).div_ceil(4096) {
                assert!(
                    c.touched & 1 << (p - lo / 4096) != 0,
                    "a live slot's page is counted"
                );
            }
        }
        let runs: Vec<(u64, u64)> = chunk_pages
            .iter()
            .map(|(&f, &(n, _))| (f as u64, f as u64 + n))
            .collect();
        for w in runs.windows(2) {
            assert!(w[0].1 <= w[1].0, "chunks overlap {w:?}");
        }
        let st = s.stats();
        assert_eq!(st.slots, live.len() as u64);
        assert_eq!(
            st.slot_bytes,
            live.iter().map(|(sl, _)| sl.size as u64).sum::<u64>()
        );
        let touched: u64 = chunk_pages
            .values()
            .map(|&(_, t)| t.count_ones() as u64)
            .sum();
        assert_eq!(st.pages, touched);
        // A freed tail is given back: the file ends where its last live chunk ends.
        assert_eq!(s.pages.end as u64, runs.last().map_or(0, |r| r.1));
        for (sl, _) in live {
            s.free(sl.id);
        }
        assert_eq!((s.stats(), s.pages.end), (SlabStats::default(), 0));
        assert!(s.pages.free.is_empty(), "free runs merge back into nothing");
    }
}
