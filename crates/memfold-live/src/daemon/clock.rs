//! The NRU clock over live guests (DE §4.2): each guest's RAM is visited a slice at a time,
//! a slice of each guest in turn, so that a full pass over a guest takes the clock interval
//! (at least 4 s in DE). The agent reports each slice's R and M bits since its last visit
//! and arms it again; the hand classifies every private page C1–C4 with the core's
//! [`PageClock`].

use std::time::{Duration, Instant};

use memfold_core::clock::PageClock;

use crate::protocol::CLOCK_SLICE;

/// One guest's clock hand and the clock state of its pages.
pub struct ClockHand {
    /// Per gfn: R, M and the idle-scan count.
    clocks: Vec<PageClock>,
    /// First gfn of the next slice.
    next: u32,
    /// When the next slice is due.
    due: Instant,
    /// Pages per class seen so far in the current pass, private pages only.
    counting: [u64; 4],
    /// Pages per class in the last full pass (C1, C2, C3, C4).
    pub last_pass: [u64; 4],
    /// Full passes completed.
    pub passes: u64,
}

impl ClockHand {
    /// A hand for a guest of `pages` pages; its first slice is due now.
    pub fn new(pages: usize) -> ClockHand {
        ClockHand {
            clocks: vec![PageClock::FRESH; pages],
            next: 0,
            due: Instant::now(),
            counting: [0; 4],
            last_pass: [0; 4],
            passes: 0,
        }
    }

    /// The next slice `(first gfn, pages)` if it is due at `now`; a pass over the guest
    /// is spread evenly over `interval`.
    pub fn due_slice(&mut self, now: Instant, interval: Duration) -> Option<(u32, u32)> {
        if now < self.due {
            return None;
        }
        let pages = self.clocks.len() as u32;
        let slices = pages.div_ceil(CLOCK_SLICE).max(1);
        let period = interval / slices;
        // A hand that fell behind (a busy daemon) restarts its rhythm from now.
        self.due = (self.due + period).max(now);
        let first = self.next;
        let count = CLOCK_SLICE.min(pages - first);
        self.next = if first + count >= pages {
            0
        } else {
            first + count
        };
        Some((first, count))
    }

    /// Applies a slice's R and M bits (bit k of word k/64 for gfn `first + k`): each
    /// private page (`private(gfn)`) is observed and scanned; at the end of the guest's
    /// RAM the pass's class counts become [`ClockHand::last_pass`].
    pub fn apply(
        &mut self,
        first: u32,
        count: u32,
        referenced: &[u64],
        modified: &[u64],
        private: impl Fn(u32) -> bool,
    ) {
        let bit = |v: &[u64], k: u32| {
            v.get(k as usize / 64)
                .is_some_and(|w| w >> (k % 64) & 1 == 1)
        };
        let end = (first + count).min(self.clocks.len() as u32);
        for g in first..end {
            if !private(g) {
                continue;
            }
            let k = g - first;
            let c = &mut self.clocks[g as usize];
            c.observe(bit(referenced, k), bit(modified, k));
            self.counting[c.scan().index()] += 1;
        }
        if end as usize >= self.clocks.len() {
            self.last_pass = std::mem::take(&mut self.counting);
            self.passes += 1;
        }
    }

    /// A page that became private again (CoW break, refill) starts recently modified.
    pub fn fresh(&mut self, gfn: u32) {
        if let Some(c) = self.clocks.get_mut(gfn as usize) {
            *c = PageClock::FRESH;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_pages_age_to_c4_and_written_ones_stay_c1() {
        let pages = 100u32;
        let mut h = ClockHand::new(pages as usize);
        let words = (pages as usize).div_ceil(64);
        let mut m = vec![0u64; words];
        m[0] = 1; // gfn 0 written every pass
        let mut r = m.clone();
        r[0] |= 2; // gfn 1 read every pass
                   // New pages start recently modified; idle ones then age C3, C4 (gfn 99 is not
                   // private and not counted).
        let expect = [[99, 0, 0, 0], [1, 1, 97, 0], [1, 1, 0, 97], [1, 1, 0, 97]];
        for (pass, want) in expect.iter().enumerate() {
            h.apply(0, pages, &r, &m, |g| g != 99);
            assert_eq!(h.passes, pass as u64 + 1);
            assert_eq!(&h.last_pass, want, "pass {}", pass + 1);
        }
    }

    #[test]
    fn slices_cover_the_guest_once_per_interval() {
        let pages = CLOCK_SLICE * 2 + 5;
        let mut h = ClockHand::new(pages as usize);
        let t0 = Instant::now();
        let iv = Duration::from_secs(3);
        let mut seen = Vec::new();
        let mut t = t0;
        while seen.len() < 3 {
            if let Some(s) = h.due_slice(t, iv) {
                seen.push(s);
            }
            t += Duration::from_millis(100);
        }
        assert_eq!(
            seen,
            vec![
                (0, CLOCK_SLICE),
                (CLOCK_SLICE, CLOCK_SLICE),
                (2 * CLOCK_SLICE, 5)
            ]
        );
        assert!(
            t - t0 >= Duration::from_secs(2),
            "slices spread over the interval"
        );
        assert_eq!(
            h.due_slice(t + iv, iv).map(|s| s.0),
            Some(0),
            "wraps around"
        );
    }
}
