//! The daemon's internal page states are still `u32`s with sentinel values; the wire
//! names pages with typed ids and enums. This module converts at the boundary, and goes
//! away when the engine rewrite gives the daemon typed states (the agent has its own:
//! `memfold-agent`'s `PageHome`).

use memfold_codecs::Encoding;
use memfold_wire::{Blob, BlobHome, FrameId, Gfn, Mapped};

/// A page's internal frame entry: no frame, the page is private.
pub(crate) const PRIVATE: u32 = u32::MAX;
/// A page's internal frame entry: a reclaimed zero page (a hole in the guest memfd).
pub(crate) const RECLAIMED: u32 = u32::MAX - 1;
/// A page's internal frame entry: stashed (patched, compressed or swapped; a hole in the
/// guest memfd, its blob in the store or the swap file).
pub(crate) const STASHED: u32 = u32::MAX - 2;
/// A stash record's reference frame when its blob is not a patch.
pub(crate) const NO_REFERENCE: u32 = u32::MAX;

/// Typed pages.
pub(crate) fn to_gfns(gfns: Vec<u32>) -> Vec<Gfn> {
    gfns.into_iter().map(Gfn).collect()
}

/// Raw pages.
pub(crate) fn gfns(gfns: &[Gfn]) -> Vec<u32> {
    gfns.iter().map(|g| g.0).collect()
}

/// Typed (page, frame) pairs.
pub(crate) fn to_pairs(pairs: Vec<(u32, u32)>) -> Vec<(Gfn, FrameId)> {
    pairs
        .into_iter()
        .map(|(g, f)| (Gfn(g), FrameId(f)))
        .collect()
}

/// Raw (page, frame) pairs.
pub(crate) fn pairs(pairs: &[(Gfn, FrameId)]) -> Vec<(u32, u32)> {
    pairs.iter().map(|&(g, f)| (g.0, f.0)).collect()
}

/// The internal frame entry of a re-attach list entry.
pub(crate) fn frame_entry(m: Mapped) -> u32 {
    match m {
        Mapped::Frame(f) => f.0,
        Mapped::ReclaimedZero => RECLAIMED,
    }
}

/// The wire blob of a stash record's encoding (`None`: the raw page) and reference frame
/// ([`NO_REFERENCE`] unless a patch).
pub(crate) fn blob(encoding: Option<Encoding>, reference: u32) -> Blob {
    debug_assert_eq!(
        matches!(encoding, Some(Encoding::Patch(_))),
        reference != NO_REFERENCE,
        "a patch, and only a patch, has a reference frame"
    );
    Blob::new(encoding, FrameId(reference))
}

/// Where a blob is, from a stash record's `in_swap`.
pub(crate) fn home(in_swap: bool) -> BlobHome {
    if in_swap {
        BlobHome::Swap
    } else {
        BlobHome::Store
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfold_codecs::{CompressCodec, PatchCodec};

    #[test]
    fn sentinels_convert_to_the_wire_and_back() {
        assert_eq!(frame_entry(Mapped::ReclaimedZero), RECLAIMED);
        assert_eq!(frame_entry(Mapped::Frame(FrameId(5))), 5);
        assert_eq!(pairs(&to_pairs(vec![(1, 2)])), vec![(1, 2)]);
        assert_eq!(gfns(&to_gfns(vec![3, 4])), vec![3, 4]);
        assert_eq!(blob(None, NO_REFERENCE), Blob::Raw);
        assert_eq!(
            blob(Some(Encoding::Compressed(CompressCodec::Lzo)), NO_REFERENCE),
            Blob::Compressed(CompressCodec::Lzo)
        );
        assert_eq!(
            blob(Some(Encoding::Patch(PatchCodec::XorLz4)), 8).reference(),
            Some(FrameId(8))
        );
        assert_eq!(home(true), BlobHome::Swap);
    }
}
