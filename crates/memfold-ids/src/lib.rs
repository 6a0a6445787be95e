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
    /// A read-only base image a block device serves (Satori §4.1, copy-on-write disks), by
    /// its file's `(st_dev, st_ino)` (`memfold-blk`'s `DiskId::of_file`): every guest whose
    /// disk reads that file names it alike.
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
    /// The id of the file `(dev, ino)`: `dev << 40 | ino` when `dev` fits 24 bits and
    /// `ino` 40 (every local file system here), else a mix of both (FNV-1a of their
    /// bytes). Two guests reading one base file get the same id, which is what lets the
    /// engine name a block by its number alone (Satori §4.1).
    pub fn of_file(dev: u64, ino: u64) -> DiskId {
        if dev < 1 << 24 && ino < 1 << 40 {
            DiskId(dev << 40 | ino)
        } else {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for b in dev.to_le_bytes().into_iter().chain(ino.to_le_bytes()) {
                h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
            // Top bit set: never equal to an exact id (whose dev fits 24 bits).
            DiskId(h | 1 << 63)
        }
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
}
