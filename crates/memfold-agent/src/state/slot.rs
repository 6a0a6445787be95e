//! A page's home as the agent's table packs it (issue 19: metadata per guest page): a
//! 4-byte slot a page ([`Packed`]) and, apart, the 20-byte record of a stashed page's blob
//! ([`Record`]), which most pages do not have.

use memfold_codecs::Encoding;
use memfold_ids::FrameId;
use memfold_wire::{Blob, BlobHome};

use super::Stash;

/// A stash record as the table keeps it: a [`Stash`] whose checksum is known, in 20 bytes
/// (issue 19: it was 32; `Option<u64>` would take 40) — five words, so that it aligns to
/// 4: the checksum in two, a patch's reference frame, and the offset (in 8-byte units,
/// [`MAX_BLOB_OFFSET`]) packed with the length, the home and the blob's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Record {
    checksum: [u32; 2],
    /// A patch's reference frame; 0 for any other blob.
    reference: u32,
    /// The offset's 8-byte units, bits 0–31.
    offset_lo: u32,
    /// Bits 0–12: the length (0..=4096). Bit 13: in the swap file. Bits 14–18: the
    /// encoding's byte ([`Encoding::to_byte`], below 31) or [`RAW`]. Bits 19–31: the
    /// offset's 8-byte units, bits 32–44.
    bits: u32,
}

/// Blob offsets a [`Record`] keeps: multiples of [`BLOB_ALIGN`] below 2^48 (256 TiB of
/// store or swap file a guest; the slab's slots are 8-byte multiples from page-aligned
/// chunks). Every stash is decoded before it is kept, and the decode refuses any other
/// (`fault.rs`, `decode_stashed`).
pub(crate) const MAX_BLOB_OFFSET: u64 = 1 << 48;
/// See [`MAX_BLOB_OFFSET`].
pub(crate) const BLOB_ALIGN: u64 = 8;

/// Whether a [`Record`] keeps a blob at byte `offset` of its file ([`MAX_BLOB_OFFSET`]):
/// the one statement of the rule, for the decode that refuses others and the record that
/// packs it.
pub(crate) fn keeps_offset(offset: u64) -> bool {
    offset < MAX_BLOB_OFFSET && offset % BLOB_ALIGN == 0
}

const LEN_MASK: u32 = (1 << 13) - 1;
const SWAP: u32 = 1 << 13;
const RECORD_KIND_SHIFT: u32 = 14;
const KIND_MASK: u32 = 0x1f;
const OFFSET_HI_SHIFT: u32 = 19;
/// [`Record`]'s kind for the raw page (no encoding's byte reaches it).
const RAW: u32 = 31;

impl Record {
    /// `s` as a record. Panics: `s` has no checksum (only the identical patch read back
    /// from the table has none, and that is never kept as a record), a length over a
    /// page, or an offset [`MAX_BLOB_OFFSET`] does not allow (the decode every stash
    /// passes first refuses both).
    pub(super) fn new(s: Stash) -> Record {
        let checksum = s.checksum.expect("a stash record without a checksum");
        assert!(
            keeps_offset(s.offset) && s.len as usize <= memfold_codecs::PAGE_SIZE,
            "a stash at byte {} of {} bytes does not pack",
            s.offset,
            s.len
        );
        let reference = match s.blob {
            Blob::Patch { reference, .. } => reference.0,
            _ => 0,
        };
        let kind = match s.blob.encoding() {
            Some(e) => {
                let b = e.to_byte() as u32;
                assert!(b < RAW, "an encoding byte of {b} does not pack");
                b
            }
            None => RAW,
        };
        let units = s.offset / BLOB_ALIGN;
        Record {
            checksum: [checksum as u32, (checksum >> 32) as u32],
            reference,
            offset_lo: units as u32,
            bits: s.len
                | if s.home == BlobHome::Swap { SWAP } else { 0 }
                | kind << RECORD_KIND_SHIFT
                | ((units >> 32) as u32) << OFFSET_HI_SHIFT,
        }
    }

    /// The record as the stash it keeps.
    pub(super) fn stash(self) -> Stash {
        let kind = (self.bits >> RECORD_KIND_SHIFT) & KIND_MASK;
        let blob = match Encoding::from_byte(kind as u8).filter(|_| kind != RAW) {
            Some(Encoding::Patch(codec)) => Blob::Patch {
                codec,
                reference: FrameId(self.reference),
            },
            Some(Encoding::Compressed(codec)) => Blob::Compressed(codec),
            None => Blob::Raw,
        };
        let units = ((self.bits >> OFFSET_HI_SHIFT) as u64) << 32 | self.offset_lo as u64;
        Stash {
            blob,
            home: if self.bits & SWAP != 0 {
                BlobHome::Swap
            } else {
                BlobHome::Store
            },
            offset: units * BLOB_ALIGN,
            len: self.bits & LEN_MASK,
            checksum: Some(self.checksum[0] as u64 | (self.checksum[1] as u64) << 32),
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
