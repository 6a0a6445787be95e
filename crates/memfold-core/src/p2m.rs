//! The P2M map: what backs each guest page, one packed 32-bit entry per gfn (DE §4.1
//! keeps the same per-gfn entry in Xen's P2M map). It includes the in-flight states of a
//! live system, where every change of a page is a request to the agent in the guest's
//! QEMU, answered later, refused, or lost with the connection.

use serde::Serialize;

use crate::ids::FrameId;

/// A blob the engine keeps for a page out of guest RAM: an index into its blob table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct BlobId(pub u32);

/// What backs one guest page.
///
/// ```text
///            share requested        agent: shared             guest writes (CoW break)
///  Private ───────────────▶ Sharing(f) ──────────▶ Shared(f) ─────────────────────────▶ Private
///     │  ▲                      │ changed / refused ▲
///     │  └──────────────────────┘                   │
///     │ reclaim requested          agent: punched       guest touches (refill)
///     ├──────────────▶ Reclaiming ─────────▶ Zero ─────────────────────────▶ Private
///     │ stash requested (blob written)  agent: punched   guest touches (decode back)
///     └──────────────▶ Stashing(b) ────────▶ Stored(b) ────────────────────▶ Private
///                           │                  │ move to swap requested: Moving(b')
///                           │ agent: punched, b the identical patch of frame f
///                           └──────────────▶ Unmapped(f) ──────────────────▶ Private
///                                                   guest touches (frame copied in)
/// ```
/// A request lost with its connection leaves the page in its in-flight state ("in
/// doubt") until the agent re-attaches with the list of what it maps, or its QEMU exits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum PageState {
    /// In guest RAM, the guest's own (also a page never touched: a hole in the memfd).
    Private,
    /// A zero page reclaimed (ESX §4.3): a hole the agent refills with zeros on access.
    Zero,
    /// Mapped read-only onto a pool frame shared copy-on-write (ESX §4.3, DE §3.1).
    Shared(FrameId),
    /// Out of guest RAM as a blob: a patch (DE §3.2), a compressed page (DE §3.3), or any
    /// of these or the raw page in the swap file (DE §4.6).
    Stored(BlobId),
    /// A share onto this frame is requested, not answered yet.
    Sharing(FrameId),
    /// A zero-page reclaim is requested, not answered yet.
    Reclaiming,
    /// A stash as this blob (already written) is requested, not answered yet.
    Stashing(BlobId),
    /// Stored; a move of its blob to this new blob (in the swap file) is requested.
    Moving(BlobId),
    /// Shared without a mapping (issue 19, `engine/unmapped.rs`): punched out of guest
    /// RAM, its bytes those of this pool frame, on which it holds a patch reference;
    /// the agent copies the frame in on the next access. No blob record: the identical
    /// patch it was stashed as is released once the agent has punched the page, so such
    /// a page costs the engine nothing beyond its P2M entry (a blob record is 24 bytes).
    Unmapped(FrameId),
}

impl PageState {
    /// Whether a request about this page is under way (or lost, in doubt).
    pub fn in_flight(self) -> bool {
        matches!(
            self,
            PageState::Sharing(_)
                | PageState::Reclaiming
                | PageState::Stashing(_)
                | PageState::Moving(_)
        )
    }
}

/// One packed P2M entry: 3 bits of state, 29 bits of payload (frame or blob). 4 bytes a
/// guest page, 0.1% of guest RAM. The zero tag's payload tells its three payload-less
/// states apart: a reclaimed zero page (0), a discarded free page (1), a reclaim in
/// flight (2), which leaves a tag for [`PageState::Unmapped`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct P2mEntry(u32);

impl P2mEntry {
    /// Largest payload (frame or blob id) an entry holds, exclusive.
    pub const MAX_PAYLOAD: u32 = 1 << 29;
    /// A private page.
    pub const PRIVATE: P2mEntry = P2mEntry(0);
    /// A free page the guest reported, discarded (issue 17, PV §3.1): a [`PageState::Zero`]
    /// hole like a reclaimed zero page, told apart only so the books can say which
    /// mechanism saved it (payload 1 of the zero tag; a reclaimed zero page has 0).
    pub const FREE_HOLE: P2mEntry = P2mEntry(1 << 29 | 1);
    /// [`PageState::Reclaiming`]: payload 2 of the zero tag.
    const RECLAIMING: P2mEntry = P2mEntry(1 << 29 | 2);

    /// A private page its agent sent to the kernel's swap (issue 15's zswap backing,
    /// [`crate::engine::CompressBacking::Zswap`]): a [`PageState::Private`] page like any
    /// other — its bytes are in guest RAM's memfd, which the kernel swaps in at the next
    /// access — told apart so that nothing reads it in again for nothing (the scans skip
    /// it) and the books know what the kernel holds; the payload of the private tag is
    /// the second it was paged out, plus one (so that 0 stays the plain private page), at
    /// most [`Self::MAX_PAYLOAD`] − 1, for the re-store wait of a page that comes back
    /// soon. Any change of state, or the agent's word that it is in RAM again, drops it.
    pub fn paged_out_at(secs: u64) -> P2mEntry {
        P2mEntry(secs.saturating_add(1).min(Self::MAX_PAYLOAD as u64 - 1) as u32)
    }

    /// The second a paged-out page left RAM ([`Self::paged_out_at`]); `None` for any
    /// other entry.
    pub fn paged_out_since(self) -> Option<u64> {
        (self.is_paged_out()).then(|| self.0 as u64 - 1)
    }

    /// Whether this is a paged-out page ([`Self::paged_out_at`]).
    pub fn is_paged_out(self) -> bool {
        self.0 >> 29 == 0 && self.0 != 0
    }

    /// Whether this is [`Self::FREE_HOLE`]: a discarded free page, not yet touched.
    pub fn is_free_hole(self) -> bool {
        self == Self::FREE_HOLE
    }

    /// Packs a state. Panics if the payload is not below [`Self::MAX_PAYLOAD`]; the
    /// allocators never hand out such numbers.
    pub fn new(s: PageState) -> P2mEntry {
        if s == PageState::Reclaiming {
            return Self::RECLAIMING;
        }
        let (tag, payload) = match s {
            PageState::Private => (0, 0),
            PageState::Zero => (1, 0),
            PageState::Shared(f) => (2, f.0),
            PageState::Stored(b) => (3, b.0),
            PageState::Sharing(f) => (4, f.0),
            PageState::Reclaiming => unreachable!("packed above"),
            PageState::Unmapped(f) => (5, f.0),
            PageState::Stashing(b) => (6, b.0),
            PageState::Moving(b) => (7, b.0),
        };
        assert!(
            payload < Self::MAX_PAYLOAD,
            "P2M payload {payload} out of range"
        );
        P2mEntry(tag << 29 | payload)
    }

    /// Unpacks the entry.
    pub fn state(self) -> PageState {
        let p = self.0 & (Self::MAX_PAYLOAD - 1);
        match self.0 >> 29 {
            0 => PageState::Private,
            1 if p == 2 => PageState::Reclaiming,
            1 => PageState::Zero,
            2 => PageState::Shared(FrameId(p)),
            3 => PageState::Stored(BlobId(p)),
            4 => PageState::Sharing(FrameId(p)),
            5 => PageState::Unmapped(FrameId(p)),
            6 => PageState::Stashing(BlobId(p)),
            _ => PageState::Moving(BlobId(p)),
        }
    }
}

impl std::fmt::Debug for P2mEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.state().fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_paged_out_page_is_private_and_told_apart() {
        let e = P2mEntry::paged_out_at(0);
        assert_eq!(e.state(), PageState::Private);
        assert!(e.is_paged_out());
        assert_eq!(P2mEntry::paged_out_at(42).paged_out_since(), Some(42));
        assert_eq!(P2mEntry::PRIVATE.paged_out_since(), None);
        assert!(P2mEntry::paged_out_at(u64::MAX).is_paged_out());
        assert_eq!(P2mEntry::paged_out_at(u64::MAX).state(), PageState::Private);
        assert!(!P2mEntry::PRIVATE.is_paged_out());
        assert!(!P2mEntry::FREE_HOLE.is_paged_out());
        assert!(!P2mEntry::new(PageState::Private).is_paged_out());
    }

    #[test]
    fn every_state_round_trips_through_its_packed_entry() {
        let m = P2mEntry::MAX_PAYLOAD - 1;
        for s in [
            PageState::Private,
            PageState::Zero,
            PageState::Shared(FrameId(m)),
            PageState::Stored(BlobId(3)),
            PageState::Sharing(FrameId(0)),
            PageState::Reclaiming,
            PageState::Stashing(BlobId(m)),
            PageState::Moving(BlobId(9)),
            PageState::Unmapped(FrameId(0)),
            PageState::Unmapped(FrameId(m)),
        ] {
            assert_eq!(P2mEntry::new(s).state(), s);
            assert!(!P2mEntry::new(s).is_free_hole(), "{s:?}");
            assert!(!P2mEntry::new(s).is_paged_out(), "{s:?}");
        }
        assert!(!P2mEntry::new(PageState::Zero).is_free_hole());
        assert_eq!(P2mEntry::PRIVATE.state(), PageState::Private);
        assert_eq!(P2mEntry::FREE_HOLE.state(), PageState::Zero);
        assert!(P2mEntry::FREE_HOLE.is_free_hole());
        assert!(!P2mEntry::new(PageState::Zero).is_free_hole());
    }
}
