//! The NRU clock over live guests (DE §4.2): each guest's RAM is visited a slice at a time,
//! a slice of each guest in turn, so that a full pass over a guest takes the clock interval
//! (at least 4 s in DE). The agent reports each slice's R and M bits since its last visit
//! and arms it again; the hand classifies every private page C1–C4 with the core's
//! [`PageClock`].

use std::time::{Duration, Instant};

use memfold_core::clock::PageClock;

use memfold_wire::CLOCK_SLICE;

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
    /// memfoldd's full-scan count when each of the last 8 passes started (pass q at
    /// q % 8): tells whether a sharing cycle has seen a page since it went idle.
    scan_marks: [u64; 8],
    /// The pass the last applied slice belonged to.
    applied_pass: u64,
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
            scan_marks: [u64::MAX; 8],
            applied_pass: 0,
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
    /// RAM the pass's class counts become [`ClockHand::last_pass`]. `full_scans` is
    /// memfoldd's count of full sharing scans started (see [`ClockHand::seen_by_sharing`]).
    pub fn apply(
        &mut self,
        first: u32,
        count: u32,
        referenced: &[u64],
        modified: &[u64],
        full_scans: u64,
        private: impl Fn(u32) -> bool,
    ) {
        let bit = |v: &[u64], k: u32| {
            v.get(k as usize / 64)
                .is_some_and(|w| w >> (k % 64) & 1 == 1)
        };
        let end = (first + count).min(self.clocks.len() as u32);
        if first == 0 {
            self.scan_marks[(self.passes % 8) as usize] = full_scans;
        }
        self.applied_pass = self.passes;
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

    /// Page `gfn`'s clock (R, M, idle scans).
    pub fn page(&self, gfn: u32) -> PageClock {
        self.clocks[gfn as usize]
    }

    /// Whether a complete sharing scan has seen page `gfn` since it was last modified
    /// (DE §4.3: patch and compress only pages "not shared in a full cycle"), given the
    /// full scans started so far. The page, idle for n scans, was last written before its
    /// visit in pass p−n; a scan that started after pass p−n+1 began and has finished
    /// (another one started since) read its present bytes.
    pub fn seen_by_sharing(&self, gfn: u32, full_scans: u64) -> bool {
        let n = self.clocks[gfn as usize].idle_scans() as u64;
        let p = self.applied_pass;
        if n == 0 || n > p + 1 {
            return false;
        }
        let mark = self.scan_marks[((p + 1 - n) % 8) as usize];
        mark != u64::MAX && full_scans >= mark + 2
    }

    /// A page that became private again by a write or an access the clock could not see
    /// (CoW break, refill, decode back) is C1 until its next scan ([`PageClock::WRITTEN`]).
    pub fn fresh(&mut self, gfn: u32) {
        if let Some(c) = self.clocks.get_mut(gfn as usize) {
            *c = PageClock::WRITTEN;
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
            h.apply(0, pages, &r, &m, pass as u64 * 2, |g| g != 99);
            // Idle pages went idle in pass 1; the scan that started after pass 2 began
            // has finished once a later one started.
            assert_eq!(h.seen_by_sharing(5, pass as u64 * 2 + 2), pass >= 1);
            assert!(!h.seen_by_sharing(0, u64::MAX - 2), "written every pass");
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
