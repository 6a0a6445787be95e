//! The global page space: one range of gpns a guest, handed back when the guest leaves.
//!
//! ESX §4.3 packs a VM and a PPN into a hint frame; memfold packs a guest's gfn offset by
//! its base into 31 bits ([`Gpn`]), so that a share-table hint and a similarity candidate
//! are 4 bytes. Bases were once only ever bumped, and the space (2^31 pages, 8 TiB of guest
//! RAM) ran out over a long-running memfoldd's life: 32 attaches of 256 GiB, or 16 384 of
//! 512 MiB, and every later guest was refused until a restart. A guest that leaves now
//! gives its range back, for the next guest to attach — but only once nothing names it:
//! the engine purges its domain's hints and similarity candidates first (`Engine::remove`),
//! so that a stale hint can never pair a page of the new guest, maybe of another domain,
//! with the old guest's domain.

use std::collections::BTreeMap;

use crate::ids::Gpn;

/// Pages of the global page space: gpns are below this.
pub(crate) const GPN_SPACE_PAGES: u64 = 1 << 31;

/// The ranges of the global page space held by guests, and the free ones between them.
#[derive(Debug, Default)]
pub(crate) struct GpnSpace {
    /// Free ranges below `end`: first gpn → pages; never two adjacent (merged on free).
    free: BTreeMap<u32, u32>,
    /// Every gpn from here up is free.
    end: u32,
}

impl GpnSpace {
    /// A range of `pages` gpns: the smallest free range that holds them (the lowest of
    /// equals), else the space's top. `None` when no range holds them: the space is
    /// fragmented or full.
    pub(crate) fn take(&mut self, pages: u32) -> Option<Gpn> {
        debug_assert!(pages > 0);
        let best = self
            .free
            .iter()
            .filter(|&(_, &len)| len >= pages)
            .min_by_key(|&(&start, &len)| (len, start))
            .map(|(&start, &len)| (start, len));
        if let Some((start, len)) = best {
            self.free.remove(&start);
            if len > pages {
                self.free.insert(start + pages, len - pages);
            }
            return Some(Gpn(start));
        }
        let end = self.end as u64 + pages as u64;
        if end > GPN_SPACE_PAGES {
            return None;
        }
        let base = self.end;
        self.end = end as u32;
        Some(Gpn(base))
    }

    /// Gives back the `pages` gpns from `base` (taken by [`Self::take`]; the caller has
    /// purged every reference to them). Merged with the free ranges beside it.
    pub(crate) fn give_back(&mut self, base: Gpn, pages: u32) {
        let (mut start, mut len) = (base.0, pages);
        debug_assert!(start as u64 + len as u64 <= self.end as u64);
        if let Some((&s, &l)) = self.free.range(..start).next_back() {
            debug_assert!(s + l <= start, "gpn {start} given back twice");
            if s + l == start {
                self.free.remove(&s);
                (start, len) = (s, l + len);
            }
        }
        if let Some(l) = self.free.remove(&(start + len)) {
            len += l;
        }
        if start + len == self.end {
            self.end = start;
        } else {
            self.free.insert(start, len);
        }
    }

    /// Whether `gpn` lies in no guest's range.
    pub(crate) fn is_free(&self, gpn: Gpn) -> bool {
        gpn.0 >= self.end
            || self
                .free
                .range(..=gpn.0)
                .next_back()
                .is_some_and(|(&s, &l)| gpn.0 < s + l)
    }

    /// Pages held by guests: the space's top less its free ranges below it.
    pub(crate) fn held_pages(&self) -> u64 {
        self.end as u64 - self.free.values().map(|&l| l as u64).sum::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_given_back_is_taken_again_and_neighbours_merge() {
        let mut s = GpnSpace::default();
        let a = s.take(100).unwrap();
        let b = s.take(50).unwrap();
        let c = s.take(100).unwrap();
        assert_eq!((a, b, c), (Gpn(0), Gpn(100), Gpn(150)));
        s.give_back(b, 50);
        assert!(s.is_free(Gpn(120)) && !s.is_free(Gpn(99)) && !s.is_free(Gpn(150)));
        // The smallest range that holds it.
        assert_eq!(s.take(30), Some(Gpn(100)));
        assert_eq!(s.take(20), Some(Gpn(130)));
        s.give_back(Gpn(100), 30);
        s.give_back(Gpn(130), 20);
        s.give_back(a, 100);
        // 0..150 is one range now: 150 pages fit in it, below c.
        assert_eq!(s.take(150), Some(Gpn(0)));
        s.give_back(Gpn(0), 150);
        // The top range given back lowers the top, and the free range below merges in.
        s.give_back(c, 100);
        assert_eq!(s.held_pages(), 0);
        assert_eq!(s.take(250), Some(Gpn(0)));
    }

    #[test]
    fn the_space_is_refused_past_2_to_the_31_pages_and_usable_again_once_given_back() {
        let mut s = GpnSpace::default();
        let big = 1u32 << 28;
        let taken: Vec<Gpn> = (0..8).map(|_| s.take(big).unwrap()).collect();
        assert_eq!(s.take(1), None, "2^31 pages are held");
        assert_eq!(s.held_pages(), GPN_SPACE_PAGES);
        s.give_back(taken[3], big);
        assert_eq!(s.take(big + 1), None, "no range of that size");
        assert_eq!(s.take(big), Some(taken[3]));
    }

    #[test]
    fn a_guest_attached_and_removed_over_and_over_never_runs_the_space_out() {
        // 512 MiB guests: 16 384 attaches filled the space when bases were only bumped.
        let mut s = GpnSpace::default();
        let keep = s.take(3).unwrap();
        for _ in 0..40_000 {
            let g = s.take(1 << 17).expect("space");
            s.give_back(g, 1 << 17);
        }
        assert_eq!(s.held_pages(), 3);
        assert!(!s.is_free(keep));
    }
}
