//! How long a page shared without a mapping stayed so, without a record a page
//! ([`UnmappedAges`]; issue 19): what its blob's store time told DE's re-store back-off.

use super::super::RESTASH_LIVED_US;
use crate::clock::ClockHand;
use crate::ids::Gfn;

/// Epochs of [`UnmappedAges`], µs: an eighth of [`RESTASH_LIVED_US`] (3.75 s).
const AGE_EPOCH_US: u64 = RESTASH_LIVED_US / 8;

/// Epochs after which a mark is dropped as long-lived: marked in epoch m and still held
/// in epoch m + 9, a page was punched more than 8 epochs ago, [`RESTASH_LIVED_US`].
const AGE_LONG_EPOCHS: u64 = 9;

/// Whether a page shared without a mapping lived out [`RESTASH_LIVED_US`] before its
/// guest touched it (DE's re-store back-off, `PageHints::restash_wait`), without a record
/// a page: such a page has no blob, so no `since_us` (issue 19: its 40-byte blob record
/// was 0.1% of an 8 GiB guest's RAM). A nibble a guest page, kept in four spare bits of
/// the page's clock word ([`ClockHand::nibble`]; an array of its own was 0.5 bytes a
/// page, 0.012% of guest RAM): 0, no mark (never punched, or long ago); else the epoch of
/// [`AGE_EPOCH_US`] it was punched in, mod 15, plus one. At each new epoch a sweep drops
/// the marks [`AGE_LONG_EPOCHS`] old, so the nibbles never wrap: a page still marked when
/// taken back lived less than 9 epochs (33.75 s) and counts as short-lived; one whose
/// mark is gone lived more than 8 (30 s). Only lives between 30 and 33.75 s are
/// misjudged, as short (the safe side: a longer back-off). Two bitmaps of 30 s epochs
/// were tried first (2 bits a page): they took lives up to 90 s for short, and pages that
/// a guest reads once a minute stayed mapped where their blobs' store times had kept them
/// unmapped.
#[derive(Clone, Debug, Default)]
pub(crate) struct UnmappedAges {
    /// The current epoch (since the guest's first), and when it began, µs.
    epoch: u64,
    epoch_us: u64,
    /// Marks held now (a sweep over no mark is skipped).
    marked: u64,
}

impl UnmappedAges {
    /// For a guest whose clock starts with no nibble set, its first epoch beginning at
    /// `now_us`. The marks live in that clock's nibbles, passed to each call.
    pub(crate) fn new(now_us: u64) -> UnmappedAges {
        UnmappedAges {
            epoch: 0,
            epoch_us: now_us,
            marked: 0,
        }
    }

    /// Epochs since the one a nibble `v` (not 0) names, in the current epoch: exact while
    /// below 15, which the sweeps keep it.
    fn age(&self, v: u8) -> u64 {
        (self.epoch % 15 + 15 - (v as u64 - 1)) % 15
    }

    /// Moves to the epoch `now_us` falls in, dropping the marks that become
    /// [`AGE_LONG_EPOCHS`] old: one pass over the clock words a new epoch (2 bytes a
    /// page, 4 MB for 8 GiB), none while nothing is marked.
    fn roll(&mut self, clock: &mut ClockHand, now_us: u64) {
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
        self.marked = clock.retain_nibbles(|v| ages[v as usize - 1] < AGE_LONG_EPOCHS);
    }

    /// Page `g` was punched, shared without a mapping, at `now_us`.
    pub(crate) fn mark(&mut self, clock: &mut ClockHand, g: Gfn, now_us: u64) {
        self.roll(clock, now_us);
        if clock.nibble(g.0) == 0 {
            self.marked += 1;
        }
        clock.set_nibble(g.0, (self.epoch % 15) as u8 + 1);
    }

    /// Page `g` is no longer unmapped at `now_us`: whether it was punched more than
    /// [`RESTASH_LIVED_US`] ago, give or take an epoch on the short side (see the type).
    /// Its mark goes.
    pub(crate) fn take(&mut self, clock: &mut ClockHand, g: Gfn, now_us: u64) -> bool {
        self.roll(clock, now_us);
        if clock.nibble(g.0) == 0 {
            return true;
        }
        clock.set_nibble(g.0, 0);
        self.marked -= 1;
        false
    }

    /// Verifies the marks in `clock`'s nibbles, for tests: `marked` counts them (a sweep
    /// is skipped when it is 0, so marks it missed would wrap), each is on a page
    /// `unmapped` says is shared without a mapping (a mark left on another page would
    /// date that page's next punch), and none is `AGE_LONG_EPOCHS` old (the sweeps
    /// drop those). Returns the first violation.
    pub(crate) fn check(
        &self,
        clock: &ClockHand,
        pages: u32,
        unmapped: impl Fn(Gfn) -> bool,
    ) -> Result<(), String> {
        let mut marks = 0;
        for g in (0..pages).map(Gfn) {
            let v = clock.nibble(g.0);
            if v == 0 {
                continue;
            }
            marks += 1;
            if !unmapped(g) {
                return Err(format!("{g}: an unmapped age on a page not unmapped"));
            }
            if self.age(v) >= AGE_LONG_EPOCHS {
                return Err(format!("{g}: an unmapped age {} epochs old", self.age(v)));
            }
        }
        if marks != self.marked {
            return Err(format!("{marks} unmapped ages, {} counted", self.marked));
        }
        Ok(())
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
                let (mut a, mut c) = (UnmappedAges::new(0), ClockHand::new(200));
                a.mark(&mut c, Gfn(130), punch);
                a.mark(&mut c, Gfn(7), punch);
                if let Some(k) = step {
                    let mut t = punch;
                    while t + k * E < back {
                        t += k * E;
                        a.mark(&mut c, Gfn(9), t);
                        a.take(&mut c, Gfn(9), t);
                    }
                }
                let what = format!("punched {punch}, back {back}, steps of {step:?} epochs");
                assert_eq!(a.take(&mut c, Gfn(130), back), long, "{what}");
                assert_eq!(a.take(&mut c, Gfn(7), back), long, "{what}");
                assert!(a.take(&mut c, Gfn(131), back), "never marked: {what}");
            }
        }
        let (mut a, mut c) = (UnmappedAges::new(0), ClockHand::new(200));
        a.mark(&mut c, Gfn(1), 0);
        a.mark(&mut c, Gfn(2), 10 * S);
        assert!(a.take(&mut c, Gfn(1), 10 * S + 1));
        assert!(!a.take(&mut c, Gfn(2), 10 * S + 2));
        assert_eq!(a.marked, 0);
        assert!(
            (0..200).all(|g| c.nibble(g) == 0),
            "no mark is left in the clock"
        );
    }
}
