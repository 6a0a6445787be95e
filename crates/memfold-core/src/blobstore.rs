//! Sub-page storage for patches and compressed pages (Difference Engine §4.1).

use std::collections::BTreeSet;

use hashbrown::HashMap;
use memfold_codecs::{CompressCodec, PatchCodec};
use serde::Serialize;

use crate::frames::{FrameStore, BLOB_CHUNK};
use crate::share::hashbrown_bytes;
use crate::types::{BlobId, Frame, PAGE_SIZE};

/// Slots per frame of each size class; a class's slot size is `4096 / slots` rounded down
/// to 8 bytes. Consecutive classes differ by at most ~33%, which bounds internal waste.
const SLOTS_PER_FRAME: [u8; 15] = [64, 48, 32, 24, 16, 12, 10, 8, 7, 6, 5, 4, 3, 2, 1];

/// What a blob encodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum BlobKind {
    /// A patch against the reference frame in [`BlobMeta::reference`].
    Patch(PatchCodec),
    /// A compressed page.
    Compressed(CompressCodec),
}

/// A stored blob's description.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlobMeta {
    /// Encoding of the blob.
    pub kind: BlobKind,
    /// Reference frame of a patch (holding one reference count), `None` for compressed pages.
    pub reference: Option<Frame>,
    /// Payload length, bytes.
    pub len: u16,
}

#[derive(Clone, Copy)]
struct Record {
    chunk: u32,
    slot: u8,
    class: u8,
    len: u16,
    kind: u8,
    reference: u32,
}

const NO_REF: u32 = u32::MAX;
const FREE_RECORD: u8 = u8::MAX;

fn encode_kind(k: BlobKind) -> u8 {
    match k {
        BlobKind::Compressed(c) => CompressCodec::ALL.iter().position(|&x| x == c).expect("known codec") as u8,
        BlobKind::Patch(p) => 16 + PatchCodec::ALL.iter().position(|&x| x == p).expect("known codec") as u8,
    }
}

fn decode_kind(k: u8) -> BlobKind {
    if k >= 16 {
        BlobKind::Patch(PatchCodec::ALL[(k - 16) as usize])
    } else {
        BlobKind::Compressed(CompressCodec::ALL[k as usize])
    }
}

struct Class {
    size: usize,
    slots: u8,
    /// Chunk frames of this class with at least one free slot, lowest first.
    partial: BTreeSet<u32>,
}

/// Packs blobs of up to one page into host frames by size class, a frame per class
/// holding equal slots (a slab allocator; DE §4.1 wrote a custom block allocator for the
/// same purpose). Frames come from and return to the [`FrameStore`], so they count as
/// host memory in use.
///
/// Memory cost per blob is its class's slot size; what frames hold beyond the payloads is
/// reported as fragmentation ([`BlobStoreStats`]).
pub struct BlobStore {
    classes: Vec<Class>,
    records: Vec<Record>,
    free_records: Vec<u32>,
    /// Per chunk frame: (class, bitmap of used slots).
    chunks: HashMap<u32, (u8, u64)>,
    payload_bytes: u64,
    slot_bytes: u64,
    live: u32,
}

/// Occupancy of the blob store, bytes unless noted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct BlobStoreStats {
    /// Live blobs (patched + compressed pages).
    pub blobs: u32,
    /// Frames holding blobs.
    pub frames: u32,
    /// Sum of blob payload lengths.
    pub payload_bytes: u64,
    /// Sum of the slot sizes of live blobs (payload + internal waste).
    pub slot_bytes: u64,
    /// Bytes of chunk frames not covered by a live slot (external fragmentation).
    pub free_slot_bytes: u64,
}

impl Default for BlobStore {
    fn default() -> Self {
        Self::new()
    }
}

impl BlobStore {
    /// An empty store.
    pub fn new() -> Self {
        let classes = SLOTS_PER_FRAME
            .iter()
            .map(|&n| Class { size: (PAGE_SIZE / n as usize) & !7, slots: n, partial: BTreeSet::new() })
            .collect();
        BlobStore { classes, records: Vec::new(), free_records: Vec::new(), chunks: HashMap::new(), payload_bytes: 0, slot_bytes: 0, live: 0 }
    }

    /// Slot size, bytes, that a blob of `len` bytes would occupy.
    pub fn slot_size(len: usize) -> usize {
        SLOTS_PER_FRAME.iter().map(|&n| (PAGE_SIZE / n as usize) & !7).find(|&s| s >= len.max(1)).unwrap_or(PAGE_SIZE)
    }

    /// Stores `bytes` (1..=4096 bytes) and returns its id. Takes a new chunk frame from
    /// `frames` when the class has no free slot; returns `None` if no frame is left.
    /// The reference frame's count is *not* touched here: the engine holds it.
    pub fn store(&mut self, frames: &mut FrameStore, bytes: &[u8], kind: BlobKind, reference: Option<Frame>) -> Option<BlobId> {
        assert!(!bytes.is_empty() && bytes.len() <= PAGE_SIZE, "blob of {} bytes", bytes.len());
        let ci = self.classes.iter().position(|c| c.size >= bytes.len()).expect("a class fits any page");
        let chunk = match self.classes[ci].partial.first() {
            Some(&c) => c,
            None => {
                let f = frames.alloc()?;
                frames.set_flag(f, BLOB_CHUNK, true);
                self.chunks.insert(f.0, (ci as u8, 0));
                self.classes[ci].partial.insert(f.0);
                f.0
            }
        };
        let class = &mut self.classes[ci];
        let used = &mut self.chunks.get_mut(&chunk).expect("chunk registered").1;
        let slot = (!*used).trailing_zeros() as u8;
        *used |= 1 << slot;
        if used.count_ones() == class.slots as u32 {
            class.partial.remove(&chunk);
        }
        let off = slot as usize * class.size;
        frames.data_mut(Frame(chunk))[off..off + bytes.len()].copy_from_slice(bytes);
        self.payload_bytes += bytes.len() as u64;
        self.slot_bytes += class.size as u64;
        self.live += 1;
        let rec = Record {
            chunk,
            slot,
            class: ci as u8,
            len: bytes.len() as u16,
            kind: encode_kind(kind),
            reference: reference.map_or(NO_REF, |f| f.0),
        };
        Some(match self.free_records.pop() {
            Some(id) => {
                self.records[id as usize] = rec;
                id
            }
            None => {
                self.records.push(rec);
                self.records.len() as u32 - 1
            }
        })
    }

    /// The blob's description. Panics on an id that is not live (an engine bug).
    pub fn meta(&self, id: BlobId) -> BlobMeta {
        let r = &self.records[id as usize];
        assert_ne!(r.kind, FREE_RECORD, "blob {id} is not live");
        BlobMeta { kind: decode_kind(r.kind), reference: (r.reference != NO_REF).then_some(Frame(r.reference)), len: r.len }
    }

    /// The blob's bytes.
    pub fn bytes<'a>(&self, frames: &'a FrameStore, id: BlobId) -> &'a [u8] {
        let r = &self.records[id as usize];
        assert_ne!(r.kind, FREE_RECORD, "blob {id} is not live");
        let off = r.slot as usize * self.classes[r.class as usize].size;
        &frames.data(Frame(r.chunk))[off..off + r.len as usize]
    }

    /// Frees the blob and returns its description; frees its chunk frame when empty. The
    /// caller drops the reference frame's count.
    pub fn remove(&mut self, frames: &mut FrameStore, id: BlobId) -> BlobMeta {
        let meta = self.meta(id);
        let r = self.records[id as usize];
        self.records[id as usize].kind = FREE_RECORD;
        self.free_records.push(id);
        let class = &mut self.classes[r.class as usize];
        let used = &mut self.chunks.get_mut(&r.chunk).expect("chunk registered").1;
        *used &= !(1u64 << r.slot);
        if *used == 0 {
            self.chunks.remove(&r.chunk);
            class.partial.remove(&r.chunk);
            frames.set_flag(Frame(r.chunk), BLOB_CHUNK, false);
            let freed = frames.decref(Frame(r.chunk));
            debug_assert!(freed);
        } else {
            class.partial.insert(r.chunk);
        }
        self.payload_bytes -= r.len as u64;
        self.slot_bytes -= class.size as u64;
        self.live -= 1;
        meta
    }

    /// Occupancy figures.
    pub fn stats(&self) -> BlobStoreStats {
        let frames = self.chunks.len() as u32;
        BlobStoreStats {
            blobs: self.live,
            frames,
            payload_bytes: self.payload_bytes,
            slot_bytes: self.slot_bytes,
            free_slot_bytes: frames as u64 * PAGE_SIZE as u64 - self.slot_bytes,
        }
    }

    /// Slot size, bytes, of a live blob.
    pub fn slot_bytes_of(&self, id: BlobId) -> usize {
        self.classes[self.records[id as usize].class as usize].size
    }

    /// Live blob ids (for invariant checks).
    pub fn live_ids(&self) -> impl Iterator<Item = BlobId> + '_ {
        self.records.iter().enumerate().filter(|(_, r)| r.kind != FREE_RECORD).map(|(i, _)| i as u32)
    }

    /// Frames holding blobs (for invariant checks).
    pub fn chunk_frames(&self) -> impl Iterator<Item = Frame> + '_ {
        self.chunks.keys().map(|&f| Frame(f))
    }

    /// Bytes of metadata: 16 bytes a record plus the chunk map.
    pub fn metadata_bytes(&self) -> usize {
        self.records.capacity() * std::mem::size_of::<Record>()
            + self.free_records.capacity() * 4
            + hashbrown_bytes(self.chunks.capacity(), 4 + 16)
            + self.classes.iter().map(|c| c.partial.len() * 8).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_pack_and_free_chunks_when_empty() {
        let mut frames = FrameStore::new();
        let mut bs = BlobStore::new();
        let kind = BlobKind::Compressed(CompressCodec::Lz4);
        assert_eq!(BlobStore::slot_size(1), 64);
        assert_eq!(BlobStore::slot_size(65), 80);
        assert_eq!(BlobStore::slot_size(2048), 2048);
        assert_eq!(BlobStore::slot_size(2049), 4096);
        let ids: Vec<_> = (0..100u8).map(|i| bs.store(&mut frames, &[i; 60], kind, None).unwrap()).collect();
        assert_eq!(bs.stats().frames, 2, "64 slots of 64 bytes per frame");
        assert_eq!(frames.in_use(), 2);
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(bs.bytes(&frames, id), &[i as u8; 60][..]);
        }
        let s = bs.stats();
        assert_eq!((s.payload_bytes, s.slot_bytes, s.free_slot_bytes), (6000, 6400, 8192 - 6400));
        for &id in &ids[..64] {
            bs.remove(&mut frames, id);
        }
        assert_eq!(bs.stats().frames, 1);
        for &id in &ids[64..] {
            bs.remove(&mut frames, id);
        }
        assert_eq!(frames.in_use(), 0);
        assert_eq!(bs.stats(), BlobStoreStats::default());
    }

    #[test]
    fn meta_round_trips() {
        let mut frames = FrameStore::new();
        let mut bs = BlobStore::new();
        let r = frames.alloc().unwrap();
        let id = bs.store(&mut frames, &[1; 700], BlobKind::Patch(PatchCodec::ZstdRef), Some(r)).unwrap();
        assert_eq!(bs.meta(id), BlobMeta { kind: BlobKind::Patch(PatchCodec::ZstdRef), reference: Some(r), len: 700 });
        assert_eq!(bs.slot_bytes_of(id), 816);
    }
}
