//! Sharing entitlements (Satori §4.2): the memory sharing saves, credited to the guests
//! that share it, in proportion to what each shares.
//!
//! For a frame `p` mapped by `n(p)` guest pages (its sharing rank), sharing saves
//! `n(p) − 1` pages; each mapping earns `(n(p) − 1) / n(p)` of them, so guest `i`'s
//! entitlement is `s(i) = Σ_{p ∈ M(i)} (n(p) − 1) / n(p)` over the frames it maps, once
//! per mapping, and the entitlements of all guests add up to exactly the pages sharing
//! saves (less the frames held only as patch references, which no guest maps).
//!
//! The books keep the exact part: each guest's shared pages counted by the rank of the
//! frame they map ([`SharingRanks`], integers, recounted from the P2M and the frame table
//! whenever the books are read — memfoldd reads them every second, as Satori interrogates
//! entitlements). `s(i)` is derived from them.
//!
//! What earns entitlement — decided here, as the paper counts sharing only:
//! - content shared with other pages, of this guest or another of its sharing domain;
//! - not zero pages, shared onto the zero frame or reclaimed as holes: they are the
//!   guest's free memory. Crediting them would pay a guest for memory it does not use,
//!   and what the balloon hands back is itself zero until used: a loop that would deflate
//!   every idle guest to its full RAM;
//! - not patched, compressed or swapped pages: those savings are the guest's own (no
//!   other guest is involved), the guest's next touch takes them back, and they are
//!   booked per guest by mechanism already ([`super::SavedBy`]).

use serde::Serialize;

use super::Engine;
use crate::ids::VmId;
use crate::p2m::PageState;

/// One guest's shared pages by the sharing rank of the frame each maps: `(rank, pages)`
/// pairs, rank ≥ 1 ascending, pages > 0. The zero frame is left out (see the module).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SharingRanks(pub Vec<(u32, u64)>);

impl SharingRanks {
    /// The sharing entitlement `s(i)` (Satori §4.2), pages: `Σ pages · (rank − 1) / rank`.
    pub fn entitlement_pages(&self) -> f64 {
        self.0
            .iter()
            .map(|&(n, pages)| pages as f64 * f64::from(n.saturating_sub(1)) / f64::from(n.max(1)))
            .sum()
    }

    /// The entitlement in whole bytes, rounded down (4 KiB pages).
    pub fn entitlement_bytes(&self) -> u64 {
        (self.entitlement_pages() * crate::PAGE_SIZE as f64) as u64
    }

    /// Pages counted (the guest's shared pages outside the zero frame).
    pub fn pages(&self) -> u64 {
        self.0.iter().map(|&(_, p)| p).sum()
    }
}

/// Ranks up to this are counted in an array; higher ones (a page shared by hundreds of
/// mappers) in a short list.
const DENSE_RANKS: usize = 64;

impl Engine {
    /// Guest `id`'s shared pages by rank (`None`: no such guest). O(the guest's pages).
    pub fn sharing_ranks(&self, id: VmId) -> Option<SharingRanks> {
        let v = self.vms.get(&id)?;
        let dom = self.domain(v.domain);
        let mut dense = [0u64; DENSE_RANKS + 1];
        let mut sparse: Vec<(u32, u64)> = Vec::new();
        for e in v.p2m.iter() {
            let PageState::Shared(f) = e.state() else {
                continue;
            };
            if dom.zero_frame == Some(f) {
                continue;
            }
            // Mappings only: a patch using the frame as its reference maps nothing.
            let n = dom.frames.refcount(f) - dom.frames.patch_refs(f);
            if (n as usize) <= DENSE_RANKS {
                dense[n as usize] += 1;
            } else {
                match sparse.iter_mut().find(|(r, _)| *r == n) {
                    Some((_, c)) => *c += 1,
                    None => sparse.push((n, 1)),
                }
            }
        }
        sparse.sort_unstable();
        let mut ranks: Vec<(u32, u64)> = dense
            .iter()
            .enumerate()
            .filter(|&(_, &c)| c > 0)
            .map(|(n, &c)| (n as u32, c))
            .collect();
        ranks.extend(sparse);
        Some(SharingRanks(ranks))
    }
}
