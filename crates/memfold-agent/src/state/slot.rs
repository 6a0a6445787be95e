//! A page's home as the agent's table packs it (issue 19: metadata per guest page): a
//! 4-byte slot a page ([`Packed`]) and, apart, the 32-byte record of a stashed page's blob
//! ([`Record`]), which most pages do not have.

use memfold_ids::FrameId;
use memfold_wire::{Blob, BlobHome};

use super::Stash;

/// A stash record as the table keeps it: a [`Stash`] whose checksum is known (32 bytes;
/// `Option<u64>` would take 40).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Record {
    blob: Blob,
    home: BlobHome,
    offset: u64,
    len: u32,
    checksum: u64,
}

impl Record {
    /// `s` as a record. Panics: `s` has no checksum (only the identical patch read back
    /// from the table has none, and that is never kept as a record).
    pub(super) fn new(s: Stash) -> Record {
        Record {
            blob: s.blob,
            home: s.home,
            offset: s.offset,
            len: s.len,
            checksum: s.checksum.expect("a stash record without a checksum"),
        }
    }

    /// The record as the stash it keeps.
    pub(super) fn stash(self) -> Stash {
        Stash {
            blob: self.blob,
            home: self.home,
            offset: self.offset,
            len: self.len,
            checksum: Some(self.checksum),
        }
    }
}

/// A page's home as the table reads it; kept packed in 4 bytes ([`Packed`]), a stashed
/// page's blob record apart ([`Pages`](super::Pages)' `stashes`), since most pages have
/// none (issue 19: the agent's records were a 32-byte [`PageHome`](super::PageHome) a
/// page, 0.78% of guest RAM; 8 bytes as this enum; 4 packed: 0.1%).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Slot {
    Private,
    Zero,
    Frame(FrameId),
    /// Index into `stashes`.
    Stashed(u32),
    /// Stashed as the identical patch against this frame ([`Stash::identical`]), with no
    /// record: memfoldd's share without a mapping, ~200 000 pages of an 8 GiB guest, each
    /// 32 bytes of record before (issue 19).
    Identical(FrameId),
}

/// Frames and stash indexes a [`Packed`] slot holds: below 2^29 (a pool of 2 TiB; a
/// region of 2 TiB). The agent refuses shares onto frames past it, and keeps a record
/// for an identical stash against one.
pub(crate) const MAX_FRAME: u32 = 1 << 29;

/// Bits of a [`Packed`] slot below its kind.
const KIND_SHIFT: u32 = MAX_FRAME.trailing_zeros();

/// A [`Slot`] in 4 bytes: a 3-bit kind over a 29-bit frame or stash index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Packed(pub(super) u32);

impl Packed {
    pub(super) const PRIVATE: Packed = Packed(0);

    /// Packs `s`. Panics: a frame or index of 2^29 or more (callers refuse such frames,
    /// and no region has that many pages).
    pub(super) fn new(s: Slot) -> Packed {
        let (kind, x) = match s {
            Slot::Private => (0, 0),
            Slot::Zero => (1, 0),
            Slot::Frame(f) => (2, f.0),
            Slot::Stashed(i) => (3, i),
            Slot::Identical(f) => (4, f.0),
        };
        assert!(x < MAX_FRAME, "{s:?} does not pack");
        Packed(kind << KIND_SHIFT | x)
    }

    pub(super) fn get(self) -> Slot {
        let x = self.0 & (MAX_FRAME - 1);
        match self.0 >> KIND_SHIFT {
            0 => Slot::Private,
            1 => Slot::Zero,
            2 => Slot::Frame(FrameId(x)),
            3 => Slot::Stashed(x),
            _ => Slot::Identical(FrameId(x)),
        }
    }
}
