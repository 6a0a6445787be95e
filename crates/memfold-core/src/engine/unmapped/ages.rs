//! How long a page shared without a mapping stayed so, without a record a page
//! ([`UnmappedAges`]; issue 19): what its blob's store time told DE's re-store back-off.

use super::super::RESTASH_LIVED_US;
use crate::ids::Gfn;

/// Epochs of [`UnmappedAges`], µs: an eighth of [`RESTASH_LIVED_US`] (3.75 s).
const AGE_EPOCH_US: u64 = RESTASH_LIVED_US / 8;

/// Epochs after which a mark is dropped as long-lived: marked in epoch m and still held
/// in epoch m + 9, a page was punched more than 8 epochs ago, [`RESTASH_LIVED_US`].
const AGE_LONG_EPOCHS: u64 = 9;

/// Whether a page shared without a mapping lived out [`RESTASH_LIVED_US`] before its
/// guest touched it (DE's re-store back-off, `PageHints::restash_wait`), without a record
/// a page: such a page has no blob, so no `since_us` (issue 19: its 40-byte blob record
/// was 0.1% of an 8 GiB guest's RAM). A nibble a guest page (0.5 bytes): 0, no mark (never
/// punched, or long ago); else the epoch of [`AGE_EPOCH_US`] it was punched in, mod 15,
/// plus one. At each new epoch a sweep drops the marks [`AGE_LONG_EPOCHS`] old, so the
/// nibbles never wrap: a page still marked when taken back lived less than 9 epochs
/// (33.75 s) and counts as short-lived; one whose mark is gone lived more than 8 (30 s).
/// Only lives between 30 and 33.75 s are misjudged, as short (the safe side: a longer
/// back-off). Two bitmaps of 30 s epochs were tried first (2 bits a page): they took
/// lives up to 90 s for short, and pages that a guest reads once a minute stayed mapped
/// where their blobs' store times had kept them unmapped.
#[derive(Clone, Debug, Default)]
pub(crate) struct UnmappedAges {
    /// The current epoch (since the guest's first), and when it began, µs.
    epoch: u64,
    epoch_us: u64,
    /// Page `g`'s nibble is the low (even `g`) or high (odd `g`) half of byte `g / 2`.
    nibbles: Vec<u8>,
    /// Marks held now (a sweep over no mark is skipped).
    marked: u64,
}

impl UnmappedAges {
    /// For a guest of `pages` pages, its first epoch beginning at `now_us`.
    pub(crate) fn new(pages: usize, now_us: u64) -> UnmappedAges {
        UnmappedAges {
            epoch: 0,
            epoch_us: now_us,
            nibbles: vec![0; pages.div_ceil(2)],
            marked: 0,
        }
    }

    fn nibble(&self, g: Gfn) -> u8 {
        (self.nibbles[g.index() / 2] >> (4 * (g.index() % 2))) & 0xf
    }

    fn set_nibble(&mut self, g: Gfn, v: u8) {
        let (b, shift) = (&mut self.nibbles[g.index() / 2], 4 * (g.index() % 2));
        *b = (*b & !(0xf << shift)) | (v << shift);
    }

    /// Epochs since the one a nibble `v` (not 0) names, in the current epoch: exact while
    /// below 15, which the sweeps keep it.
    fn age(&self, v: u8) -> u64 {
        (self.epoch % 15 + 15 - (v as u64 - 1)) % 15
    }

    /// Moves to the epoch `now_us` falls in, dropping the marks that become
    /// [`AGE_LONG_EPOCHS`] old: one pass over the nibbles a new epoch (a byte per two
    /// pages, ~1 MB for 8 GiB), none while nothing is marked.
    fn roll(&mut self, now_us: u64) {
        let n = now_us.saturating_sub(self.epoch_us) / AGE_EPOCH_US;
        if n == 0 {
            return;
        }
        // Ages before the move are at most AGE_LONG_EPOCHS - 1 (the last sweep's doing).
        let ages: Vec<u64> = (1..16u8).map(|v| self.age(v) + n).collect();
        self.epoch += n;
        self.epoch_us += n * AGE_EPOCH_US;
        if self.marked == 0 {
            return;
        }
        let keep = |v: u8| v != 0 && ages[v as usize - 1] < AGE_LONG_EPOCHS;
        let mut marked = 0;
        for b in &mut self.nibbles {
            let (lo, hi) = (*b & 0xf, *b >> 4);
            let lo = if keep(lo) { lo } else { 0 };
            let hi = if keep(hi) { hi } else { 0 };
            marked += u64::from(lo != 0) + u64::from(hi != 0);
            *b = lo | hi << 4;
        }
        self.marked = marked;
    }

    /// Page `g` was punched, shared without a mapping, at `now_us`.
    pub(crate) fn mark(&mut self, g: Gfn, now_us: u64) {
        self.roll(now_us);
        if self.nibble(g) == 0 {
            self.marked += 1;
        }
        self.set_nibble(g, (self.epoch % 15) as u8 + 1);
    }

    /// Page `g` is no longer unmapped at `now_us`: whether it was punched more than
    /// [`RESTASH_LIVED_US`] ago, give or take an epoch on the short side (see the type).
    /// Its mark goes.
    pub(crate) fn take(&mut self, g: Gfn, now_us: u64) -> bool {
        self.roll(now_us);
        let v = self.nibble(g);
        if v == 0 {
            return true;
        }
        self.set_nibble(g, 0);
        self.marked -= 1;
        false
    }

    /// Bytes it holds.
    pub(crate) fn bytes(&self) -> usize {
        self.nibbles.capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page taken back within [`RESTASH_LIVED_US`] of its punch never counts as long
    /// lived; one taken back more than an epoch past it always does; marks go with the
    /// take, and survive any jump of time without wrapping.
    #[test]
    fn unmapped_ages_tell_long_lives_from_short_ones_on_the_safe_side() {
        const S: u64 = RESTASH_LIVED_US;
        const E: u64 = AGE_EPOCH_US;
        for (punch, back, long) in [
            (0, 0, false),
            (0, S - 1, false),
            (S / 2, S / 2 + S - 1, false),
            (E - 1, E - 1 + S - 1, false), // across nine epoch changes, under S
            (0, S + E, true),
            (E - 1, E - 1 + S + E, true),
            (S / 2, 3 * S, true),
            (S / 2, 100 * S, true),
            (7 * S + 3, 7 * S + 3 + S + E, true),
            (7 * S + 3, 7 * S + 3 + S - 2, false),
        ] {
            // Taken at once, and after other marks and takes that roll the epochs in
            // every step of one to eight epochs.
            for step in [None, Some(1), Some(2), Some(5), Some(8)] {
                let mut a = UnmappedAges::new(200, 0);
                a.mark(Gfn(130), punch);
                a.mark(Gfn(7), punch);
                if let Some(k) = step {
                    let mut t = punch;
                    while t + k * E < back {
                        t += k * E;
                        a.mark(Gfn(9), t);
                        a.take(Gfn(9), t);
                    }
                }
                let what = format!("punched {punch}, back {back}, steps of {step:?} epochs");
                assert_eq!(a.take(Gfn(130), back), long, "{what}");
                assert_eq!(a.take(Gfn(7), back), long, "{what}");
                assert!(a.take(Gfn(131), back), "never marked: {what}");
            }
        }
        let mut a = UnmappedAges::new(200, 0);
        a.mark(Gfn(1), 0);
        a.mark(Gfn(2), 10 * S);
        assert!(a.take(Gfn(1), 10 * S + 1));
        assert!(!a.take(Gfn(2), 10 * S + 2));
        assert_eq!((a.bytes(), a.marked), (100, 0));
    }
}
