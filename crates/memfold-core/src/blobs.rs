//! Blobs of pages kept out of guest RAM (Difference Engine §4.1): where each lives — the
//! store (host memory, for patches and compressed pages) or the swap file (disk, DE §4.6)
//! — packed into chunks of 4 KiB pages by the [`Slab`], and what each holds.

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
    /// slot is free again.
    pub fn put(&mut self, blob: &[u8]) -> Result<Slot, StoreError> {
        let slot = self
            .slab
            .alloc(blob.len())
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
            self.free(slot.id);
            return Err(StoreError::Io {
                home: self.home,
                source,
            });
        }
        Ok(slot)
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

/// One blob: whose page it keeps, where, and how to decode it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blob {
    /// The page's VM.
    pub vm: VmId,
    /// The page.
    pub gfn: Gfn,
    /// Where it lives.
    pub home: BlobHome,
    /// Its slot.
    pub slot: SlotId,
    /// Byte offset in its space.
    pub offset: u64,
    /// Length, bytes.
    pub len: u32,
    /// Slot size, bytes.
    pub size: u32,
    /// What it holds.
    pub form: Form,
    /// A patch's reference frame, holding one reference count.
    pub reference: Option<FrameId>,
    /// When the page was stored, µs (its lifetime starts here).
    pub since_us: u64,
    /// For a move to swap: the blob this one replaces once the agent confirms.
    pub replaces: Option<BlobId>,
    /// The page's checksum (`memfold_codecs::page_checksum`): checked on every decode.
    pub checksum: u64,
    /// The page is identical to its reference frame: a page shared without a mapping
    /// (issue 19; ESX §4.3's sharing, kept as DE §3.2's degenerate patch), booked as
    /// sharing while it is in the store.
    pub identical: bool,
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
    /// A page identical to its reference frame, in the store: shared without a mapping.
    Unmapped,
}

impl Blob {
    /// What keeps the page out of RAM.
    pub fn kept(&self) -> Kept {
        match (self.home, self.form) {
            (BlobHome::Swap, _) => Kept::Swapped,
            (BlobHome::Store, _) if self.identical => Kept::Unmapped,
            (BlobHome::Store, Form::Encoded(e)) if e.is_patch() => Kept::Patched,
            _ => Kept::Compressed,
        }
    }
}

/// The blobs, by id.
#[derive(Default)]
pub struct BlobTable {
    blobs: Vec<Option<Blob>>,
    free: Vec<u32>,
    live: usize,
}

impl BlobTable {
    /// Records a blob; returns its id.
    pub fn insert(&mut self, b: Blob) -> BlobId {
        self.live += 1;
        match self.free.pop() {
            Some(i) => {
                self.blobs[i as usize] = Some(b);
                BlobId(i)
            }
            None => {
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

    /// Forgets blob `id` and returns it.
    pub fn remove(&mut self, id: BlobId) -> Blob {
        let b = self.blobs[id.0 as usize].take().expect("live blob");
        self.free.push(id.0);
        self.live -= 1;
        b
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
