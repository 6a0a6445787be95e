//! Blobs of pages kept out of guest RAM (Difference Engine §4.1): where each lives — the
//! store (host memory, for patches and compressed pages) or the swap file (disk, DE §4.6)
//! — packed into chunks of 4 KiB pages by the [`Slab`], and what each holds.

use std::collections::HashMap;

use memfold_codecs::Encoding;
use serde::Serialize;

use crate::backing::{Backing, BackingError};
use crate::ids::{FrameId, Gfn, SlotId, VmId};
use crate::p2m::BlobId;
use crate::slab::{Slab, SlabStats, Slot};

/// Where a blob lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum BlobHome {
    /// The store: host memory (a memfd the agents read).
    Store,
    /// The swap file: disk (DE §4.6).
    Swap,
}

/// What a blob holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Form {
    /// The page encoded: a patch (against [`Blob::reference`]) or compressed.
    Encoded(Encoding),
    /// The page itself, 4096 bytes (swapped out, neither patched nor compressed under the
    /// cut-off; only in the swap file).
    Raw,
}

/// Why a blob space could not take a blob.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The swap file is full; the page stays in guest RAM.
    #[error("swap file full ({capacity} bytes); the page stays in guest RAM")]
    Full {
        /// Its capacity, bytes.
        capacity: u64,
    },
    /// The blob's length is over a page.
    #[error("no slot for a blob of {0} bytes (0..=4096)")]
    BadLength(usize),
    /// The backing failed (host out of memory, disk full).
    #[error("{home:?}: {source}")]
    Io {
        /// Which space.
        home: BlobHome,
        /// The backing's error.
        source: BackingError,
    },
}

/// The store grows 4 MiB at a time.
const GROW_BYTES: u64 = 4 << 20;

/// A blob space: a backing laid out by a slab allocator.
pub struct BlobSpace {
    home: BlobHome,
    backing: Box<dyn Backing>,
    slab: Slab,
    size: u64,
    capacity: Option<u64>,
}

impl BlobSpace {
    /// A space over `backing` (empty), at most `capacity` bytes (`None`: unbounded).
    pub fn new(home: BlobHome, backing: Box<dyn Backing>, capacity: Option<u64>) -> Self {
        BlobSpace {
            home,
            backing,
            slab: Slab::new(),
            size: 0,
            capacity,
        }
    }

    /// Where its blobs live.
    pub fn home(&self) -> BlobHome {
        self.home
    }

    /// Writes `blob` into a free slot.
    ///
    /// Errors: [`StoreError::Full`], [`StoreError::BadLength`], [`StoreError::Io`]; the
    /// slot is free again, and the books count no page that only this blob would have
    /// reached (a write that failed part-way has those pages punched out: the store holds
    /// what the books say).
    pub fn put(&mut self, blob: &[u8]) -> Result<Slot, StoreError> {
        let slot = self
            .slab
            .reserve(blob.len())
            .ok_or(StoreError::BadLength(blob.len()))?;
        if blob.is_empty() {
            return Ok(slot); // no bytes to write (crate::slab::EMPTY)
        }
        let end = slot.offset + slot.size as u64;
        if let Some(capacity) = self.capacity.filter(|&c| end > c) {
            self.free(slot.id);
            return Err(StoreError::Full { capacity });
        }
        let written = (|| {
            if end > self.size {
                let size = end.div_ceil(GROW_BYTES) * GROW_BYTES;
                self.backing.resize(size)?;
                self.size = size;
            }
            self.backing.write(slot.offset, blob)
        })();
        if let Err(source) = written {
            // A write may fail part-way, its first bytes allocating pages no written
            // slot covers: release them, so the store does not hold more than the books.
            for (offset, len) in self.slab.unheld_pages(slot.id) {
                self.backing.release(offset, len);
            }
            self.free(slot.id);
            return Err(StoreError::Io {
                home: self.home,
                source,
            });
        }
        self.slab.written(slot.id);
        Ok(slot)
    }

    /// Where live slot `id` is and its size. Panics on a slot that is not live (an
    /// engine bug: every live blob holds its slot; [`BlobSpace::find_slot`] asks).
    pub fn slot(&self, id: SlotId) -> Slot {
        self.slab.slot(id).expect("a live blob's slot")
    }

    /// Where slot `id` is and its size; `None` if it is not live.
    pub fn find_slot(&self, id: SlotId) -> Option<Slot> {
        self.slab.slot(id)
    }

    /// Frees a slot, releasing its chunk from the backing if it is now empty.
    pub fn free(&mut self, slot: SlotId) {
        if let Some((offset, len)) = self.slab.free(slot) {
            self.backing.release(offset, len);
        }
    }

    /// Reads a blob's bytes.
    ///
    /// Errors: the backing's.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BackingError> {
        if out.is_empty() {
            return Ok(()); // an empty blob: nothing in the backing
        }
        self.backing.read(offset, out)
    }

    /// Makes written blobs durable and drops them from the host's cache (swap).
    ///
    /// Errors: the backing's write-back failed.
    pub fn sync(&mut self) -> Result<(), BackingError> {
        self.backing.sync()
    }

    /// Occupancy: slots, chunks and slot bytes.
    pub fn stats(&self) -> SlabStats {
        self.slab.stats()
    }

    /// Capacity, bytes (`None`: unbounded).
    pub fn capacity(&self) -> Option<u64> {
        self.capacity
    }

    /// Bytes of host memory (or disk) the backing holds.
    pub fn allocated_bytes(&self) -> u64 {
        self.backing.allocated_bytes()
    }
}

/// One blob: whose page it keeps, where, and how to decode it. 24 bytes (it was 64, then
/// 40, then 32): no checksum (the page's agent keeps one with its own record and checks
/// every decode against it; a move to swap, the one request that needs it again, gets it
/// by decoding the blob: `Engine::stored_page_checksum`), its byte offset and slot size are its slot's ([`BlobSpace::slot`]), a move's old
/// blob is in [`BlobTable::replaces`] (moves in flight are few), the reference frame is
/// kept in 4 bytes ([`Blob::reference`]), the time it was stored in deciseconds
/// ([`Blob::since_us`]), and its length, home and identical flag share 2 bytes —
/// issue 19's metadata, docs/metadata.md.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blob {
    /// When the page was stored, deciseconds of the engine's clock (saturating: 13.6
    /// years).
    since_ds: u32,
    /// The page's VM.
    pub vm: VmId,
    /// The page.
    pub gfn: Gfn,
    /// Its slot in its space (offset and size: [`BlobSpace::slot`]).
    pub slot: SlotId,
    /// A patch's reference frame (holding one reference count), or [`NO_FRAME`].
    reference: u32,
    /// Length in bytes (bits 0–12: 0..=4096), home (bit 13: swap) and identical (bit 14).
    bits: u16,
    /// What it holds.
    pub form: Form,
}

/// [`Blob::reference`]'s "none": a frame id no pool hands out (the agents' page slots
/// refuse frames past 2^29, docs/metadata.md).
const NO_FRAME: u32 = u32::MAX;

/// [`Blob`]'s `bits`: the length's mask and the flags above it.
const LEN_MASK: u16 = (1 << 13) - 1;
const SWAP_BIT: u16 = 1 << 13;
const IDENTICAL_BIT: u16 = 1 << 14;

/// Microseconds a [`Blob`]'s time of storing is kept in (a decisecond): lifetimes are
/// read against marks of a second and more ([`crate::engine::LIFETIME_MARKS_S`]) and the
/// restash threshold of 30 s.
const SINCE_UNIT_US: u64 = 100_000;

impl Blob {
    /// A blob record. `len` is at most a page (4096 bytes); `reference` must not be
    /// `FrameId(u32::MAX)` (no pool reaches it); `since_us` is kept to a decisecond
    /// (rounded down: a lifetime read from it is at most 100 ms too long).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        vm: VmId,
        gfn: Gfn,
        home: BlobHome,
        slot: SlotId,
        len: u32,
        form: Form,
        reference: Option<FrameId>,
        since_us: u64,
        identical: bool,
    ) -> Blob {
        let reference = reference.map_or(NO_FRAME, |f| {
            assert_ne!(f.0, NO_FRAME, "frame id out of range");
            f.0
        });
        assert!(len as usize <= crate::PAGE_SIZE, "a blob of {len} bytes");
        let bits = len as u16
            | if home == BlobHome::Swap { SWAP_BIT } else { 0 }
            | if identical { IDENTICAL_BIT } else { 0 };
        Blob {
            since_ds: u32::try_from(since_us / SINCE_UNIT_US).unwrap_or(u32::MAX),
            vm,
            gfn,
            slot,
            reference,
            bits,
            form,
        }
    }

    /// A patch's reference frame, holding one reference count.
    pub fn reference(&self) -> Option<FrameId> {
        (self.reference != NO_FRAME).then_some(FrameId(self.reference))
    }

    /// Length, bytes (0..=4096).
    pub fn len(&self) -> u32 {
        (self.bits & LEN_MASK) as u32
    }

    /// Whether the blob is empty (an identical page's patch).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where it lives.
    pub fn home(&self) -> BlobHome {
        if self.bits & SWAP_BIT != 0 {
            BlobHome::Swap
        } else {
            BlobHome::Store
        }
    }

    /// The page is identical to its reference frame: a page being shared without a
    /// mapping (issue 19; ESX §4.3's sharing, stashed as DE §3.2's degenerate patch).
    /// The record lasts only while the stash is in flight: once the agent has punched the
    /// page, its P2M entry names the frame (`PageState::Unmapped`) and the record goes.
    pub fn identical(&self) -> bool {
        self.bits & IDENTICAL_BIT != 0
    }

    /// When the page was stored, µs of the engine's clock, to a decisecond (its lifetime
    /// starts here).
    pub fn since_us(&self) -> u64 {
        self.since_ds as u64 * SINCE_UNIT_US
    }
}

/// What keeps a stored page out of RAM, for the books.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kept {
    /// A patch in the store.
    Patched,
    /// A compressed page in the store.
    Compressed,
    /// Anything in the swap file.
    Swapped,
    /// A page identical to its reference frame: shared without a mapping (an identical
    /// blob in flight, or a `PageState::Unmapped` page, which has no blob).
    Unmapped,
}

impl Blob {
    /// What keeps the page out of RAM.
    pub fn kept(&self) -> Kept {
        match (self.home(), self.form) {
            (BlobHome::Swap, _) => Kept::Swapped,
            (BlobHome::Store, _) if self.identical() => Kept::Unmapped,
            (BlobHome::Store, Form::Encoded(e)) if e.is_patch() => Kept::Patched,
            _ => Kept::Compressed,
        }
    }
}

/// Blob records the table grows by at least (32 KiB of them).
const GROW_MIN: usize = 1024;

/// Blob ids at most: what a P2M entry's payload names (29 bits; 2 TiB of stored pages).
pub const MAX_BLOBS: usize = crate::p2m::P2mEntry::MAX_PAYLOAD as usize;

/// The blobs, by id. The record vector grows by an eighth, not doubled (issue 19: a
/// doubled vector of 300 000 records would hold up to 9.6 MB it does not use), and its
/// ids are kept, so it holds as many records as were ever live at once.
#[derive(Default)]
pub struct BlobTable {
    blobs: Vec<Option<Blob>>,
    free: Vec<u32>,
    live: usize,
    /// Moves to swap in flight (DE §4.6): the new blob → the blob it replaces once the
    /// agent confirms. Apart from the records, which would each carry 8 bytes for it.
    moves: HashMap<BlobId, BlobId>,
    /// Ids at most, if fewer than [`MAX_BLOBS`] (tests).
    limit: Option<usize>,
}

impl BlobTable {
    /// Whether a new blob would get no id: every id a P2M entry can name
    /// ([`MAX_BLOBS`]) is live. The engine asks before it writes a blob, and leaves the
    /// page in RAM then.
    pub fn full(&self) -> bool {
        self.free.is_empty() && self.blobs.len() >= self.limit.unwrap_or(MAX_BLOBS)
    }

    /// At most `n` ids from now on (tests: [`MAX_BLOBS`] records take gigabytes).
    #[cfg(test)]
    pub(crate) fn set_limit(&mut self, n: usize) {
        self.limit = Some(n);
    }

    /// Records a blob; returns its id. Panics if the table is [`BlobTable::full`] (an
    /// engine bug: its id would not fit a P2M entry).
    pub fn insert(&mut self, b: Blob) -> BlobId {
        assert!(!self.full(), "a blob recorded with every blob id live");
        self.live += 1;
        match self.free.pop() {
            Some(i) => {
                self.blobs[i as usize] = Some(b);
                BlobId(i)
            }
            None => {
                if self.blobs.len() == self.blobs.capacity() {
                    self.blobs
                        .reserve_exact((self.blobs.len() / 8).max(GROW_MIN));
                }
                self.blobs.push(Some(b));
                BlobId(self.blobs.len() as u32 - 1)
            }
        }
    }

    /// Whether blob `id` is live.
    pub fn contains(&self, id: BlobId) -> bool {
        self.blobs.get(id.0 as usize).is_some_and(Option::is_some)
    }

    /// The blob `id`. Panics if it is not live (an engine bug).
    pub fn get(&self, id: BlobId) -> &Blob {
        self.blobs[id.0 as usize].as_ref().expect("live blob")
    }

    /// The blob `id`, mutable.
    pub fn get_mut(&mut self, id: BlobId) -> &mut Blob {
        self.blobs[id.0 as usize].as_mut().expect("live blob")
    }

    /// Forgets blob `id` (and the move it is the new blob of) and returns it.
    pub fn remove(&mut self, id: BlobId) -> Blob {
        let b = self.blobs[id.0 as usize].take().expect("live blob");
        self.moves.remove(&id);
        self.free.push(id.0);
        self.live -= 1;
        b
    }

    /// The blob that live blob `new` replaces once its move to swap is confirmed.
    pub fn replaces(&self, new: BlobId) -> Option<BlobId> {
        self.moves.get(&new).copied()
    }

    /// Records that `new` replaces `old` (a move to swap, DE §4.6).
    pub fn set_replaces(&mut self, new: BlobId, old: BlobId) {
        debug_assert!(self.contains(new) && self.contains(old));
        self.moves.insert(new, old);
    }

    /// Forgets and returns what `new` replaces (the move ended, or was orphaned).
    pub fn take_replaces(&mut self, new: BlobId) -> Option<BlobId> {
        self.moves.remove(&new)
    }

    /// Bytes it holds: the record vector as allocated (free records and spare room
    /// included: it was the live records alone until 2026-11-29, the one structure of
    /// [`crate::engine::Engine::metadata_bytes`] not counted as allocated), its free list
    /// and its moves.
    pub fn metadata_bytes(&self) -> usize {
        self.blobs.capacity() * std::mem::size_of::<Option<Blob>>()
            + self.free.capacity() * 4
            + crate::share::hashbrown_bytes(self.moves.capacity(), 8)
    }

    /// Live blobs.
    pub fn len(&self) -> usize {
        self.live
    }

    /// True if no blob is live.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Every live blob.
    pub fn iter(&self) -> impl Iterator<Item = (BlobId, &Blob)> {
        self.blobs
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.as_ref().map(|b| (BlobId(i as u32), b)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::mem::MemBacking;

    #[test]
    fn blobs_land_where_the_slab_says_and_empty_chunks_are_released() {
        let b = MemBacking::new();
        let mut s = BlobSpace::new(BlobHome::Store, Box::new(b.clone()), None);
        let x = s.put(&[1u8; 100]).unwrap();
        let y = s.put(&[2u8; 3000]).unwrap();
        let mut back = vec![0u8; 100];
        s.read(x.offset, &mut back).unwrap();
        assert_eq!(back, vec![1u8; 100]);
        assert_eq!(s.allocated_bytes(), 8192);
        s.free(y.id);
        assert_eq!(s.allocated_bytes(), 4096, "the emptied chunk is released");
        assert_eq!(s.put(&[0u8; 4097]), Err(StoreError::BadLength(4097)));
        // An empty blob takes no bytes, and is read back as nothing.
        let e = s.put(&[]).unwrap();
        assert_eq!((e.size, s.allocated_bytes()), (0, 4096));
        s.read(e.offset, &mut []).unwrap();
        s.free(e.id);
        b.file().fail_writes = true;
        assert!(matches!(s.put(&[3u8; 10]), Err(StoreError::Io { .. })));
        assert_eq!(s.stats().slots, 1, "a failed put frees its slot");
    }

    /// A put that fails — a write error that landed all but its last byte, or a refusal
    /// past the capacity — leaves the books holding what the store holds: no page that
    /// only its slot would have reached is counted, and none it wrote stays allocated.
    #[test]
    fn a_failed_put_leaves_the_books_as_the_store() {
        let held = |s: &BlobSpace| (s.stats().pages * 4096, s.allocated_bytes());
        let b = MemBacking::new();
        let mut s = BlobSpace::new(BlobHome::Store, Box::new(b.clone()), None);
        // Slots of 3072 bytes, 4 in a 3-page chunk: slot 0 covers page 0.
        let a = s.put(&[1u8; 3000]).unwrap();
        assert_eq!(held(&s), (4096, 4096));
        // Slot 1 (3072..6144) reaches page 1, new to the chunk; its write fails part-way.
        b.file().fail_writes = true;
        assert!(matches!(s.put(&[2u8; 3000]), Err(StoreError::Io { .. })));
        assert_eq!(s.stats().slots, 1, "a failed put frees its slot");
        assert_eq!(
            held(&s),
            (4096, 4096),
            "page 1: not counted, not left allocated"
        );
        let mut back = vec![0u8; 3000];
        s.read(a.offset, &mut back).unwrap();
        assert_eq!(back, vec![1u8; 3000], "the live slot's bytes are untouched");
        // The slot again, written this time: page 1 is held and counted.
        b.file().fail_writes = false;
        let c = s.put(&[3u8; 3000]).unwrap();
        assert_eq!(c.offset, 3072);
        assert_eq!(held(&s), (8192, 8192));
        // Freed in a live chunk, its pages stay (the chunk is punched whole when empty);
        // a failed write over pages already held changes nothing.
        s.free(c.id);
        assert_eq!(held(&s), (8192, 8192));
        b.file().fail_writes = true;
        assert!(s.put(&[4u8; 3000]).is_err());
        assert_eq!(held(&s), (8192, 8192));
        b.file().fail_writes = false;
        s.free(a.id);
        assert_eq!(held(&s), (0, 0), "the emptied chunk is released");

        // Refused past the capacity: slot 2 (6144..9216) reaches page 2.
        let mut w = BlobSpace::new(BlobHome::Swap, Box::new(MemBacking::new()), Some(8192));
        w.put(&[5u8; 3000]).unwrap();
        w.put(&[6u8; 3000]).unwrap();
        assert!(matches!(
            w.put(&[7u8; 3000]),
            Err(StoreError::Full { capacity: 8192 })
        ));
        assert_eq!(held(&w), (8192, 8192), "no page for a refused blob");
    }

    #[test]
    fn a_blob_record_is_24_bytes_and_keeps_its_reference_and_move() {
        assert_eq!(std::mem::size_of::<Blob>(), 24);
        assert_eq!(
            std::mem::size_of::<Option<Blob>>(),
            24,
            "a niche holds the None"
        );
        let b = |r| {
            let form = Form::Raw;
            Blob::new(
                VmId(1),
                Gfn(2),
                BlobHome::Store,
                SlotId(3),
                9,
                form,
                r,
                4,
                false,
            )
        };
        assert_eq!(b(Some(FrameId(0))).reference(), Some(FrameId(0)));
        assert_eq!(
            b(Some(FrameId(u32::MAX - 1))).reference(),
            Some(FrameId(u32::MAX - 1))
        );
        assert_eq!(b(None).reference(), None);
        let mut t = BlobTable::default();
        let (old, new) = (t.insert(b(None)), t.insert(b(None)));
        t.set_replaces(new, old);
        assert_eq!(t.replaces(new), Some(old));
        assert_eq!(t.replaces(old), None);
        t.remove(new);
        assert_eq!(t.replaces(new), None, "a removed blob's move is forgotten");
    }

    #[test]
    fn a_blob_record_keeps_its_length_home_flag_and_time_apart() {
        let forms = [
            Form::Raw,
            Form::Encoded(Encoding::Patch(memfold_codecs::PatchCodec::RunDiff)),
            Form::Encoded(Encoding::Compressed(memfold_codecs::CompressCodec::Zstd)),
        ];
        for len in [0u32, 1, 2048, 4095, 4096] {
            for home in [BlobHome::Store, BlobHome::Swap] {
                for identical in [false, true] {
                    for form in forms {
                        let b = Blob::new(
                            VmId(7),
                            Gfn(u32::MAX - 1),
                            home,
                            SlotId(9),
                            len,
                            form,
                            None,
                            123_456_789,
                            identical,
                        );
                        let got = (b.len(), b.home(), b.identical(), b.form, b.gfn);
                        assert_eq!(got, (len, home, identical, form, Gfn(u32::MAX - 1)));
                        // Kept to a decisecond, rounded down.
                        assert_eq!(b.since_us(), 123_400_000);
                    }
                }
            }
        }
        assert_eq!(
            raw_stored_at(u64::MAX).since_us(),
            u32::MAX as u64 * 100_000,
            "saturates"
        );
    }

    /// A 1-byte raw blob of page 1 of VM 1, stored at `us`.
    fn raw_stored_at(us: u64) -> Blob {
        Blob::new(
            VmId(1),
            Gfn(1),
            BlobHome::Store,
            SlotId(1),
            1,
            Form::Raw,
            None,
            us,
            false,
        )
    }

    /// The table grows by an eighth, and says what it holds as allocated: free records
    /// and spare room too. Doubling, or counting live records alone, fails it.
    #[test]
    fn the_blob_table_grows_by_an_eighth_and_counts_what_it_holds() {
        let b = raw_stored_at(0);
        let mut t = BlobTable::default();
        let ids: Vec<BlobId> = (0..20_000).map(|_| t.insert(b)).collect();
        let held = t.metadata_bytes();
        let records = held / std::mem::size_of::<Option<Blob>>();
        assert!(records >= 20_000, "{records} records for 20 000 live");
        assert!(
            records <= 20_000 + 20_000 / 8 + GROW_MIN,
            "{records}: grown by more than an eighth"
        );
        for &id in &ids[..15_000] {
            t.remove(id);
        }
        assert!(t.metadata_bytes() >= held, "free records are still held");
        for _ in 0..15_000 {
            t.insert(b);
        }
        assert!(
            t.metadata_bytes() <= held + 16_384 * 4,
            "freed ids are used again"
        );
    }

    #[test]
    fn a_full_swap_space_refuses_and_takes_blobs_again_once_freed() {
        let mut s = BlobSpace::new(BlobHome::Swap, Box::new(MemBacking::new()), Some(8192));
        let a = s.put(&[7u8; 4096]).unwrap();
        s.put(&[8u8; 4096]).unwrap();
        assert_eq!(
            s.put(&[9u8; 4096]),
            Err(StoreError::Full { capacity: 8192 })
        );
        s.free(a.id);
        assert_eq!(s.put(&[9u8; 4096]).unwrap().offset, a.offset);
    }
}
