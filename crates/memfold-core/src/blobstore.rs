//! Sub-page storage for patches and compressed pages (Difference Engine §4.1).

use serde::Serialize;

use crate::frames::{FrameStore, BLOB_CHUNK, CLASS_SHIFT};
use crate::types::{BlobId, Frame, P2mEntry, PAGE_SIZE};

/// Slots per frame of each size class; a class's slot size is `4096 / slots` rounded down
/// to 8 bytes. Consecutive classes differ by at most ~33%, which bounds internal waste.
const SLOTS_PER_FRAME: [u8; 15] = [64, 48, 32, 24, 16, 12, 10, 8, 7, 6, 5, 4, 3, 2, 1];

/// Bytes of the header stored in front of each blob in its slot: reference frame (u32),
/// payload length (u16), kind (u8), padding.
pub const BLOB_HEADER: usize = 8;

/// Largest payload a blob can hold, bytes.
pub const MAX_BLOB: usize = PAGE_SIZE - BLOB_HEADER;

/// What a blob encodes: the codecs' [`Encoding`].
pub use memfold_codecs::Encoding as BlobKind;

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

const NO_REF: u32 = u32::MAX;

/// Number of slot size classes.
pub const CLASSES: usize = SLOTS_PER_FRAME.len();

/// Slots per frame of size class `class` (0..[`CLASSES`]).
pub fn class_slots(class: usize) -> u32 {
    SLOTS_PER_FRAME[class] as u32
}

/// Slot size of class `class`, bytes.
pub fn class_size(class: usize) -> usize {
    (PAGE_SIZE / SLOTS_PER_FRAME[class] as usize) & !7
}

/// The smallest class whose slots hold `bytes` (1..=[`PAGE_SIZE`]).
pub fn class_fitting(bytes: usize) -> usize {
    (0..CLASSES)
        .find(|&c| class_size(c) >= bytes.max(1))
        .expect("a class fits any blob up to a page")
}

fn encode_kind(k: BlobKind) -> u8 {
    k.to_byte()
}

fn decode_kind(k: u8) -> BlobKind {
    BlobKind::from_byte(k).expect("written by encode_kind")
}

/// One frame of blob slots, all of one class (kept in the frame's flag byte, so that a
/// chunk entry is 12 bytes).
#[derive(Clone, Copy)]
struct Chunk {
    frame: u32,
    used: [u32; 2],
}

impl Chunk {
    fn used(&self) -> u64 {
        self.used[0] as u64 | (self.used[1] as u64) << 32
    }
    fn set_used(&mut self, v: u64) {
        self.used = [v as u32, (v >> 32) as u32];
    }
}

/// A blob id is `chunk index << 6 | slot`: it fits a P2M entry's 29-bit payload, for up to
/// 2^23 chunk frames (32 GiB of blobs).
const SLOT_BITS: u32 = 6;

/// Packs blobs of up to one page into host frames by size class, a frame per class
/// holding equal slots (a slab allocator; DE §4.1 wrote a custom block allocator for the
/// same purpose). Frames come from and return to the [`FrameStore`], so they count as
/// host memory in use.
///
/// Each blob's description (reference frame, length, codec) is an 8-byte header inside its
/// slot, so the store keeps no per-blob record: its metadata is 12 bytes per chunk frame.
/// Memory cost per blob is its class's slot size, header included; what frames hold
/// beyond the slots in use is reported as fragmentation ([`BlobStoreStats`]).
pub struct BlobStore {
    chunks: Vec<Chunk>,
    free_chunks: Vec<u32>,
    /// Per class, chunk indexes with a free slot (a stack: most recently freed first).
    partial: [Vec<u32>; SLOTS_PER_FRAME.len()],
    payload_bytes: u64,
    slot_bytes: u64,
    live: u32,
    live_chunks: u32,
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
    /// Sum of the slot sizes of live blobs (payload + 8-byte header + internal waste).
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
        BlobStore {
            chunks: Vec::new(),
            free_chunks: Vec::new(),
            partial: Default::default(),
            payload_bytes: 0,
            slot_bytes: 0,
            live: 0,
            live_chunks: 0,
        }
    }

    /// Slot size, bytes, that a blob of `len` payload bytes occupies (header included).
    pub fn slot_size(len: usize) -> usize {
        class_size(Self::class_for(len))
    }

    fn class_for(len: usize) -> usize {
        class_fitting(len + BLOB_HEADER)
    }

    /// The blob's chunk, class and byte offset in the chunk frame.
    fn locate(&self, frames: &FrameStore, id: BlobId) -> (Chunk, usize, usize) {
        let chunk = self.chunks[(id >> SLOT_BITS) as usize];
        let slot = (id & ((1 << SLOT_BITS) - 1)) as usize;
        assert!(chunk.used() & (1 << slot) != 0, "blob {id} is not live");
        let class = (frames.flags(Frame(chunk.frame)) >> CLASS_SHIFT) as usize;
        (chunk, class, slot * class_size(class))
    }

    /// Stores `bytes` (1..=[`MAX_BLOB`] bytes) and returns its id. Takes a new chunk frame
    /// from `frames` when the class has no free slot; returns `None` if no frame (or chunk
    /// number) is left. The reference frame's count is *not* touched: the engine holds it.
    pub fn store(
        &mut self,
        frames: &mut FrameStore,
        bytes: &[u8],
        kind: BlobKind,
        reference: Option<Frame>,
    ) -> Option<BlobId> {
        assert!(
            !bytes.is_empty() && bytes.len() <= MAX_BLOB,
            "blob of {} bytes",
            bytes.len()
        );
        let class = Self::class_for(bytes.len());
        let ci = match self.partial[class].last() {
            Some(&c) => c,
            None => {
                let f = frames.alloc()?;
                let chunk = Chunk {
                    frame: f.0,
                    used: [0, 0],
                };
                let ci = match self.free_chunks.pop() {
                    Some(ci) => {
                        self.chunks[ci as usize] = chunk;
                        ci
                    }
                    None if ((self.chunks.len() as u32) << SLOT_BITS) < P2mEntry::MAX_PAYLOAD => {
                        self.chunks.push(chunk);
                        self.chunks.len() as u32 - 1
                    }
                    None => {
                        frames.decref(f);
                        return None;
                    }
                };
                frames.set_flag(f, BLOB_CHUNK, true);
                frames.set_class(f, class as u8);
                self.partial[class].push(ci);
                self.live_chunks += 1;
                ci
            }
        };
        let size = class_size(class);
        let chunk = &mut self.chunks[ci as usize];
        let slot = (!chunk.used()).trailing_zeros();
        chunk.set_used(chunk.used() | 1 << slot);
        if chunk.used().count_ones() == SLOTS_PER_FRAME[class] as u32 {
            self.partial[class].pop();
        }
        let off = slot as usize * size;
        let dst = &mut frames.data_mut(Frame(chunk.frame))[off..off + BLOB_HEADER + bytes.len()];
        dst[0..4].copy_from_slice(&reference.map_or(NO_REF, |f| f.0).to_le_bytes());
        dst[4..6].copy_from_slice(&(bytes.len() as u16).to_le_bytes());
        dst[6] = encode_kind(kind);
        dst[7] = 0;
        dst[BLOB_HEADER..].copy_from_slice(bytes);
        self.payload_bytes += bytes.len() as u64;
        self.slot_bytes += size as u64;
        self.live += 1;
        Some(ci << SLOT_BITS | slot)
    }

    /// The blob's description. Panics on an id that is not live (an engine bug).
    pub fn meta(&self, frames: &FrameStore, id: BlobId) -> BlobMeta {
        let (chunk, _, off) = self.locate(frames, id);
        let h = &frames.data(Frame(chunk.frame))[off..off + BLOB_HEADER];
        let r = u32::from_le_bytes(h[0..4].try_into().expect("4 bytes"));
        BlobMeta {
            kind: decode_kind(h[6]),
            reference: (r != NO_REF).then_some(Frame(r)),
            len: u16::from_le_bytes([h[4], h[5]]),
        }
    }

    /// The blob's payload.
    pub fn bytes<'a>(&self, frames: &'a FrameStore, id: BlobId) -> &'a [u8] {
        let (chunk, _, off) = self.locate(frames, id);
        let d = &frames.data(Frame(chunk.frame))[off..];
        let len = u16::from_le_bytes([d[4], d[5]]) as usize;
        &d[BLOB_HEADER..BLOB_HEADER + len]
    }

    /// Frees the blob and returns its description; frees its chunk frame when empty. The
    /// caller drops the reference frame's count.
    pub fn remove(&mut self, frames: &mut FrameStore, id: BlobId) -> BlobMeta {
        let meta = self.meta(frames, id);
        let (_, class, _) = self.locate(frames, id);
        let ci = id >> SLOT_BITS;
        let chunk = &mut self.chunks[ci as usize];
        let was_full = chunk.used().count_ones() == SLOTS_PER_FRAME[class] as u32;
        chunk.set_used(chunk.used() & !(1u64 << (id & ((1 << SLOT_BITS) - 1))));
        if chunk.used() == 0 {
            let f = Frame(chunk.frame);
            if let Some(pos) = self.partial[class].iter().rposition(|&c| c == ci) {
                self.partial[class].swap_remove(pos);
            }
            self.free_chunks.push(ci);
            self.live_chunks -= 1;
            frames.set_flag(f, BLOB_CHUNK, false);
            let freed = frames.decref(f);
            debug_assert!(freed);
        } else if was_full {
            self.partial[class].push(ci);
        }
        self.payload_bytes -= meta.len as u64;
        self.slot_bytes -= class_size(class) as u64;
        self.live -= 1;
        meta
    }

    /// Occupancy figures.
    pub fn stats(&self) -> BlobStoreStats {
        BlobStoreStats {
            blobs: self.live,
            frames: self.live_chunks,
            payload_bytes: self.payload_bytes,
            slot_bytes: self.slot_bytes,
            free_slot_bytes: self.live_chunks as u64 * PAGE_SIZE as u64 - self.slot_bytes,
        }
    }

    /// Slot size, bytes, of a live blob.
    pub fn slot_bytes_of(&self, frames: &FrameStore, id: BlobId) -> usize {
        class_size(self.locate(frames, id).1)
    }

    /// Live blob ids (for invariant checks).
    pub fn live_ids(&self) -> impl Iterator<Item = BlobId> + '_ {
        self.chunks.iter().enumerate().flat_map(|(ci, c)| {
            (0..64u32)
                .filter(move |s| c.used() & (1 << s) != 0)
                .map(move |s| (ci as u32) << SLOT_BITS | s)
        })
    }

    /// Frames holding blobs (for invariant checks).
    pub fn chunk_frames(&self) -> impl Iterator<Item = Frame> + '_ {
        self.chunks
            .iter()
            .filter(|c| c.used() != 0)
            .map(|c| Frame(c.frame))
    }

    /// Bytes of metadata: 12 bytes a chunk (its frame and slot bitmap) plus the
    /// partial and free chunk lists.
    pub fn metadata_bytes(&self) -> usize {
        self.chunks.capacity() * std::mem::size_of::<Chunk>()
            + self.free_chunks.capacity() * 4
            + self.partial.iter().map(|p| p.capacity() * 4).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfold_codecs::{CompressCodec, PatchCodec};

    #[test]
    fn classes_pack_and_free_chunks_when_empty() {
        let mut frames = FrameStore::new();
        let mut bs = BlobStore::new();
        let kind = BlobKind::Compressed(CompressCodec::Lz4);
        assert_eq!(BlobStore::slot_size(1), 64);
        assert_eq!(BlobStore::slot_size(56), 64);
        assert_eq!(BlobStore::slot_size(57), 80);
        assert_eq!(BlobStore::slot_size(2040), 2048);
        assert_eq!(BlobStore::slot_size(2041), 4096);
        let ids: Vec<_> = (0..100u8)
            .map(|i| bs.store(&mut frames, &[i; 50], kind, None).unwrap())
            .collect();
        assert_eq!(bs.stats().frames, 2, "64 slots of 64 bytes per frame");
        assert_eq!(frames.in_use(), 2);
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(bs.bytes(&frames, id), &[i as u8; 50][..]);
        }
        let s = bs.stats();
        assert_eq!(
            (s.payload_bytes, s.slot_bytes, s.free_slot_bytes),
            (5000, 6400, 8192 - 6400)
        );
        for &id in &ids[..64] {
            bs.remove(&mut frames, id);
        }
        assert_eq!(bs.stats().frames, 1);
        // A freed slot is reused.
        let again = bs.store(&mut frames, &[7; 10], kind, None).unwrap();
        assert_eq!(bs.stats().frames, 1);
        bs.remove(&mut frames, again);
        for &id in &ids[64..] {
            bs.remove(&mut frames, id);
        }
        assert_eq!(frames.in_use(), 0);
        assert_eq!(bs.stats(), BlobStoreStats::default());
        assert_eq!(bs.live_ids().count(), 0);
    }

    #[test]
    fn meta_round_trips() {
        let mut frames = FrameStore::new();
        let mut bs = BlobStore::new();
        let r = frames.alloc().unwrap();
        let id = bs
            .store(
                &mut frames,
                &[1; 700],
                BlobKind::Patch(PatchCodec::ZstdRef),
                Some(r),
            )
            .unwrap();
        assert_eq!(
            bs.meta(&frames, id),
            BlobMeta {
                kind: BlobKind::Patch(PatchCodec::ZstdRef),
                reference: Some(r),
                len: 700
            }
        );
        assert_eq!(bs.slot_bytes_of(&frames, id), 816);
        assert_eq!(bs.live_ids().collect::<Vec<_>>(), vec![id]);
    }
}
