//! # memfold-ids
//!
//! Typed identifiers, so that a guest frame number is never passed where a host frame
//! is meant. Each is a `u32` (a batch number a `u64`) with `serde(transparent)`, so the
//! wire carries plain numbers. The engine (`memfold-core`), the wire (`memfold-wire`)
//! and the agent all name pages with these.
//!
//! | id | names | paper |
//! |---|---|---|
//! | [`VmId`] | a guest managed by memfoldd | |
//! | [`Gfn`] | a 4 KiB page of one guest's physical memory | DE §4.1 (gfn) |
//! | [`Gpn`] | a gfn offset by its VM's base: one page space over all guests | ESX §4.3 hint frames |
//! | [`DomainId`] | a sharing domain: the guests that may share frames, with a pool of their own | ESX §4.3, issue 14 |
//! | [`FrameId`] | a 4 KiB frame of a domain's pool (shared pages, reference pages) | ESX §4.3 (MPN), DE §4.1 (mfn) |
//! | [`SlotId`] | a blob slot in the store or the swap file | DE §4.1 block allocator |
//! | [`BatchId`] | one request to an agent and its answer | |

#![forbid(unsafe_code)]
#![deny(missing_docs)]

use serde::{Deserialize, Serialize};

macro_rules! id {
    ($(#[$doc:meta])* $name:ident($int:ty), $prefix:literal) => {
        $(#[$doc])*
        #[derive(
            Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub $int);

        impl $name {
            /// The id as an index into a table.
            #[inline]
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

id!(
    /// A guest managed by memfoldd. Never reused within one memfoldd.
    VmId(u32),
    "vm"
);
id!(
    /// Guest frame number: the index of a 4 KiB page in one guest's physical memory (its
    /// RAM memfd, page by page).
    Gfn(u32),
    "gfn "
);
id!(
    /// Global page number: a gfn offset by its VM's base, one page space over every
    /// guest, so that a share-table hint or a similarity candidate fits 31 bits (ESX §4.3
    /// packs a VM and a PPN into its hint frames for the same reason).
    Gpn(u32),
    "gpn "
);
id!(
    /// A sharing domain: the guests that may share frames with one another. Each domain
    /// has a pool of its own, and a guest's agent only ever receives its own domain's
    /// pool, so no QEMU holds a descriptor through which it could read frames of another
    /// domain. Never reused within one memfoldd.
    DomainId(u32),
    "domain "
);
id!(
    /// A 4 KiB frame of a domain's pool: bytes `[id·4096, (id+1)·4096)` of the pool memfd. Holds
    /// a page shared copy-on-write (ESX §4.3) or a patch reference page (DE §3.2).
    FrameId(u32),
    "frame "
);
id!(
    /// A slot of a blob (patch, compressed or raw page) in the store memfd or the swap
    /// file: `chunk << 6 | slot`, as the slab allocator hands them out (DE §4.1).
    SlotId(u32),
    "slot "
);
id!(
    /// A request to an agent, echoed in its answer.
    BatchId(u64),
    "batch "
);

id!(
    /// A read-only base image a block device serves (Satori §4.1, copy-on-write disks), as
    /// its bytes are: its file's `(st_dev, st_ino)` with its size and mtime
    /// ([`DiskId::of_file`]). Every guest whose disk reads that file names it alike while
    /// it is unchanged; a base rewritten in place (same file, new bytes) is another disk,
    /// so no block learnt of its old bytes names its new ones.
    DiskId(u64),
    "disk "
);
id!(
    /// A block device's request to have a read served from frames (Satori §5.2), echoed
    /// in the answer. Chosen by the device; unique among its requests under way.
    FillId(u64),
    "fill "
);

/// A 4 KiB block of a read-only base image: bytes `[block·4096, +4096)` of `disk`. The
/// same bytes for every guest that reads it while the base is unchanged (Satori §4.1:
/// "the block number is sufficient to identify it uniquely").
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BaseBlock {
    /// The base image.
    pub disk: DiskId,
    /// The block, 4 KiB units.
    pub block: u64,
}

impl DiskId {
    /// The id of file `(dev, ino)` holding `size` bytes, last modified at `mtime_ns` (ns
    /// since the epoch): a 64-bit hash (XXH3) of the four. Two guests reading one
    /// unchanged base file get the same id, which is what lets the engine name a block by
    /// its number alone (Satori §4.1); a write, truncation or extension of the file moves
    /// its mtime or size and so gives it a new id, and the blocks memfoldd learnt under
    /// the old one (frames holding the old bytes) are never served for it. A write within
    /// one timestamp tick of the last change, or whose mtime is then set back, is not
    /// seen (as by `memfold-blk`'s base guard).
    pub fn of_file(dev: u64, ino: u64, size: u64, mtime_ns: i128) -> DiskId {
        let mut b = [0u8; 40];
        b[..8].copy_from_slice(&dev.to_le_bytes());
        b[8..16].copy_from_slice(&ino.to_le_bytes());
        b[16..24].copy_from_slice(&size.to_le_bytes());
        b[24..].copy_from_slice(&mtime_ns.to_le_bytes());
        DiskId(xxhash_rust::xxh3::xxh3_64(&b))
    }

    /// [`DiskId::of_file`] of the file `m` describes (`std::fs::metadata`, `fstat`).
    pub fn of_metadata(m: &std::fs::Metadata) -> DiskId {
        use std::os::unix::fs::MetadataExt;
        let mtime_ns = m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128;
        DiskId::of_file(m.dev(), m.ino(), m.size(), mtime_ns)
    }
}

impl Gfn {
    /// The byte offset of this page in its guest's RAM.
    #[inline]
    pub fn offset(self) -> u64 {
        self.0 as u64 * 4096
    }
}

impl FrameId {
    /// The byte offset of this frame in the pool.
    #[inline]
    pub fn offset(self) -> u64 {
        self.0 as u64 * 4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_plain_numbers_on_the_wire_and_say_what_they_are() {
        let g = Gfn(7);
        assert_eq!(serde_json::to_string(&g).unwrap(), "7");
        assert_eq!(g.to_string(), "gfn 7");
        assert_eq!(FrameId(2).offset(), 8192);
        assert_eq!(serde_json::from_str::<BatchId>("9").unwrap(), BatchId(9));
    }

    /// A disk's id is its file and its bytes' stamp: the same for the same four, another
    /// when any one differs (a base rewritten in place changes size or mtime). Fails
    /// with the id of `(dev, ino)` alone.
    #[test]
    fn a_disk_id_names_a_file_as_its_bytes_are() {
        let id = DiskId::of_file(0xfd00, 12, 1 << 30, 1_700_000_000_123_456_789);
        assert_eq!(
            id,
            DiskId::of_file(0xfd00, 12, 1 << 30, 1_700_000_000_123_456_789)
        );
        for other in [
            DiskId::of_file(0xfd01, 12, 1 << 30, 1_700_000_000_123_456_789),
            DiskId::of_file(0xfd00, 13, 1 << 30, 1_700_000_000_123_456_789),
            DiskId::of_file(0xfd00, 12, (1 << 30) + 4096, 1_700_000_000_123_456_789),
            DiskId::of_file(0xfd00, 12, 1 << 30, 1_700_000_000_123_456_790),
            DiskId::of_file(12, 0xfd00, 1 << 30, 1_700_000_000_123_456_789),
        ] {
            assert_ne!(id, other);
        }
    }
}
