//! Host frames: page-sized storage with compact reference counts (ESX §4.3).

use hashbrown::HashMap;

use crate::types::{Frame, P2mEntry, Page, PAGE_SIZE};

/// Frames per arena chunk: host memory is taken from the allocator 1 MiB at a time.
const CHUNK_FRAMES: usize = 256;
/// Refcount value meaning "the true count is in the overflow table".
const OVERFLOW: u16 = u16::MAX;

/// Frame flag: the frame is entered in the share table as a shared frame.
pub(crate) const IN_SHARE_TABLE: u8 = 1;
/// Frame flag: the frame holds sub-page blobs (blob store chunk).
pub(crate) const BLOB_CHUNK: u8 = 2;
/// The upper four flag bits of a blob chunk frame hold its size class.
pub(crate) const CLASS_SHIFT: u8 = 4;

/// The engine's host frames: their bytes, a reference count each and a free list.
///
/// Reference counts follow ESX §4.3: a 16-bit count per frame, and an overflow table for
/// the rare frame (typically the zero page, or a popular library page) referenced more
/// than 65 534 times. Metadata is 3 bytes per frame (count + flags); the free list costs
/// nothing: each free frame holds the number of the next in its first 4 bytes.
///
/// A frame's count is the number of P2M mappings onto it plus the number of patches that
/// use it as their reference page. A frame is freed when its count reaches zero.
pub struct FrameStore {
    chunks: Vec<Box<[u8]>>,
    refcount: Vec<u16>,
    flags: Vec<u8>,
    overflow: HashMap<u32, u32>,
    free_head: u32,
    in_use: u32,
}

const NO_FRAME: u32 = u32::MAX;

impl Default for FrameStore {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameStore {
    /// An empty store; frames are allocated on demand.
    pub fn new() -> Self {
        FrameStore {
            chunks: Vec::new(),
            refcount: Vec::new(),
            flags: Vec::new(),
            overflow: HashMap::new(),
            free_head: NO_FRAME,
            in_use: 0,
        }
    }

    /// Frames currently allocated (count > 0).
    pub fn in_use(&self) -> u32 {
        self.in_use
    }

    /// Allocates a frame with count 1. Its bytes are whatever the last user left: callers
    /// always overwrite the whole page. Returns `None` when frame numbers are exhausted
    /// (2^29 frames, 2 TiB).
    pub fn alloc(&mut self) -> Option<Frame> {
        if self.free_head == NO_FRAME {
            let n = self.refcount.len();
            if n + CHUNK_FRAMES > P2mEntry::MAX_PAYLOAD as usize {
                return None;
            }
            self.chunks
                .push(vec![0u8; CHUNK_FRAMES * PAGE_SIZE].into_boxed_slice());
            self.refcount.reserve_exact(CHUNK_FRAMES);
            self.flags.reserve_exact(CHUNK_FRAMES);
            self.refcount.resize(n + CHUNK_FRAMES, 0);
            self.flags.resize(n + CHUNK_FRAMES, 0);
            // Link the new frames low to high so neighbouring allocations stay neighbours.
            for i in (n..n + CHUNK_FRAMES).rev() {
                self.push_free(i as u32);
            }
        }
        let f = self.free_head;
        self.free_head = u32::from_ne_bytes(self.data(Frame(f))[..4].try_into().expect("4 bytes"));
        debug_assert_eq!(self.refcount[f as usize], 0);
        self.refcount[f as usize] = 1;
        self.in_use += 1;
        Some(Frame(f))
    }

    fn push_free(&mut self, f: u32) {
        let head = self.free_head;
        self.data_mut(Frame(f))[..4].copy_from_slice(&head.to_ne_bytes());
        self.free_head = f;
    }

    /// The frame's bytes.
    pub fn data(&self, f: Frame) -> &Page {
        let i = f.0 as usize;
        let chunk = &self.chunks[i / CHUNK_FRAMES];
        let off = (i % CHUNK_FRAMES) * PAGE_SIZE;
        (&chunk[off..off + PAGE_SIZE])
            .try_into()
            .expect("page-sized slice")
    }

    /// The frame's bytes, writable. Callers write only frames no one else can see
    /// (count 1, private) or blob chunks.
    pub fn data_mut(&mut self, f: Frame) -> &mut Page {
        let i = f.0 as usize;
        let chunk = &mut self.chunks[i / CHUNK_FRAMES];
        let off = (i % CHUNK_FRAMES) * PAGE_SIZE;
        (&mut chunk[off..off + PAGE_SIZE])
            .try_into()
            .expect("page-sized slice")
    }

    /// Current reference count (0 for a free frame).
    pub fn refcount(&self, f: Frame) -> u32 {
        match self.refcount[f.0 as usize] {
            OVERFLOW => self.overflow[&f.0],
            c => c as u32,
        }
    }

    /// Adds one reference.
    pub fn incref(&mut self, f: Frame) {
        let c = &mut self.refcount[f.0 as usize];
        debug_assert!(*c > 0, "incref of free frame {f:?}");
        if *c == OVERFLOW {
            *self.overflow.get_mut(&f.0).expect("overflowed frame") += 1;
        } else if *c == OVERFLOW - 1 {
            *c = OVERFLOW;
            self.overflow.insert(f.0, OVERFLOW as u32);
        } else {
            *c += 1;
        }
    }

    /// Drops one reference; frees the frame (and returns true) when it was the last.
    /// The caller takes a frame that is about to be freed out of the share table first.
    pub fn decref(&mut self, f: Frame) -> bool {
        let i = f.0 as usize;
        let c = &mut self.refcount[i];
        debug_assert!(*c > 0, "decref of free frame {f:?}");
        if *c == OVERFLOW {
            let big = self.overflow.get_mut(&f.0).expect("overflowed frame");
            *big -= 1;
            if *big == (OVERFLOW - 1) as u32 {
                self.overflow.remove(&f.0);
                *c = OVERFLOW - 1;
            }
            return false;
        }
        *c -= 1;
        if *c == 0 {
            self.flags[i] = 0;
            self.push_free(f.0);
            self.in_use -= 1;
            true
        } else {
            false
        }
    }

    /// The frame's flags ([`IN_SHARE_TABLE`], [`BLOB_CHUNK`]).
    pub(crate) fn flags(&self, f: Frame) -> u8 {
        self.flags[f.0 as usize]
    }

    /// Sets the flag byte's upper four bits (a blob chunk's size class).
    pub(crate) fn set_class(&mut self, f: Frame, class: u8) {
        let v = &mut self.flags[f.0 as usize];
        *v = (*v & ((1 << CLASS_SHIFT) - 1)) | class << CLASS_SHIFT;
    }

    pub(crate) fn set_flag(&mut self, f: Frame, flag: u8, on: bool) {
        let v = &mut self.flags[f.0 as usize];
        if on {
            *v |= flag
        } else {
            *v &= !flag
        }
    }

    /// Frames with count > 0, in frame order (for invariant checks and accounting).
    pub fn allocated(&self) -> impl Iterator<Item = Frame> + '_ {
        (0..self.refcount.len() as u32)
            .filter(|&i| self.refcount[i as usize] != 0)
            .map(Frame)
    }

    /// Bytes of metadata: counts, flags and overflow table (not the frames).
    pub fn metadata_bytes(&self) -> usize {
        self.refcount.capacity() * 2
            + self.flags.capacity()
            + crate::share::hashbrown_bytes(self.overflow.capacity(), 8)
    }

    /// Bytes of host memory reserved for frames (allocated chunks, used or free).
    pub fn reserved_bytes(&self) -> usize {
        self.chunks.len() * CHUNK_FRAMES * PAGE_SIZE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refcounts_overflow_into_the_table_and_back() {
        let mut fs = FrameStore::new();
        let f = fs.alloc().unwrap();
        for _ in 0..70_000 {
            fs.incref(f);
        }
        assert_eq!(fs.refcount(f), 70_001);
        assert_eq!(fs.overflow.len(), 1);
        for _ in 0..70_000 {
            assert!(!fs.decref(f));
        }
        assert_eq!(fs.refcount(f), 1);
        assert!(fs.overflow.is_empty());
        assert!(fs.decref(f));
        assert_eq!(fs.in_use(), 0);
    }

    #[test]
    fn the_free_list_reuses_frames_lowest_first() {
        let mut fs = FrameStore::new();
        let a: Vec<_> = (0..300).map(|_| fs.alloc().unwrap()).collect();
        assert_eq!(a[0], Frame(0));
        assert_eq!(a[299], Frame(299));
        fs.decref(a[7]);
        fs.decref(a[3]);
        assert_eq!(fs.alloc(), Some(Frame(3)));
        assert_eq!(fs.alloc(), Some(Frame(7)));
        assert_eq!(fs.alloc(), Some(Frame(300)));
        assert_eq!(fs.allocated().count(), 301);
    }
}
