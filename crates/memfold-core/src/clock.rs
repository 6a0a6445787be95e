//! The not-recently-used clock (Difference Engine §4.2) and the policies that read it.
//!
//! Over live guests each guest's RAM is visited a slice at a time, a slice of each guest
//! in turn, so that a full pass over a guest takes the clock interval (at least 4 s in
//! DE). The agent reports each slice's R and M bits since its last visit and arms it
//! again; the [`ClockHand`] classifies every private page C1–C4 with its [`PageClock`].

use serde::Serialize;

/// A page's freshness class (DE §4.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum NruState {
    /// Recently modified (M set).
    C1,
    /// Not recently modified, but referenced (R set, M clear).
    C2,
    /// Not accessed since the last scan (R and M clear).
    C3,
    /// Not accessed for an extended period: C3 in consecutive scans.
    C4,
}

impl NruState {
    /// Index 0..4 for tables.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// One page's clock byte: R (bit 0), M (bit 1), the number of consecutive scans that
/// found it idle (bits 2..4, saturating at 7) and whether the last scan found it modified
/// (bit 5). DE keeps R/M in the P2M entry and "two additional bits" for C4; we keep a
/// whole idle count so that compression can also wait for a full multi-pass sharing cycle
/// (DE §4.3), and the last class so that a mechanism running between scans (the live
/// sharing scan) can ignore C1 pages as the policy says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageClock(u8);

const R: u8 = 1;
const M: u8 = 2;
const AGE_SHIFT: u8 = 2;
const AGE_MAX: u8 = 7;
const LAST_M: u8 = 1 << 5;

impl PageClock {
    /// A page the clock has not scanned yet: recently modified for its first scan, but
    /// of no known class until then ([`PageClock::last_state`] says C2).
    pub const FRESH: PageClock = PageClock(R | M);

    /// A page just written where the clock could not see it (a CoW break, a refill of a
    /// reclaimed page, a page decoded back): C1 until a scan finds otherwise.
    pub const WRITTEN: PageClock = PageClock(R | M | LAST_M);

    /// Records a guest access: R, and M for a write.
    #[inline]
    pub fn touch(&mut self, write: bool) {
        self.0 |= if write { R | M } else { R };
    }

    /// Records referenced/modified bits observed by other means (e.g. the kernel's
    /// dirty tracking in the live layer).
    #[inline]
    pub fn observe(&mut self, referenced: bool, modified: bool) {
        if referenced {
            self.0 |= R;
        }
        if modified {
            self.0 |= R | M;
        }
    }

    /// Consecutive idle scans so far.
    pub fn idle_scans(self) -> u8 {
        (self.0 >> AGE_SHIFT) & AGE_MAX
    }

    /// The class the last scan found (DE §4.2): C1 if it found the page modified (or it
    /// is [`PageClock::WRITTEN`]), C2 if referenced or not scanned yet, C3 after one idle
    /// scan, C4 after more. For mechanisms that act between scans; R and M seen since the
    /// last scan do not count until the next.
    pub fn last_state(self) -> NruState {
        if self.0 & LAST_M != 0 {
            return NruState::C1;
        }
        match self.idle_scans() {
            0 => NruState::C2,
            1 => NruState::C3,
            _ => NruState::C4,
        }
    }

    /// The class the page is in now, without scanning it.
    pub fn state(self) -> NruState {
        if self.0 & M != 0 {
            NruState::C1
        } else if self.0 & R != 0 {
            NruState::C2
        } else if self.idle_scans() >= 2 {
            NruState::C4
        } else {
            NruState::C3
        }
    }

    /// One clock scan of the page (DE §4.2): classifies it, clears R and M, and counts
    /// consecutive idle scans.
    pub fn scan(&mut self) -> NruState {
        let idle = self.0 & (R | M) == 0;
        let age = if idle {
            (self.idle_scans() + 1).min(AGE_MAX)
        } else {
            0
        };
        self.0 = age << AGE_SHIFT | (self.0 & (R | M));
        let state = self.state();
        self.0 &= !(R | M);
        if state == NruState::C1 {
            self.0 |= LAST_M;
        }
        state
    }
}

/// Most pages in one clock slice: the agent reports R/M bits a slice at a time.
pub const CLOCK_SLICE: u32 = 16384;

/// One guest's clock hand and the clock state of its pages.
pub struct ClockHand {
    /// Per gfn: R, M and the idle-scan count.
    clocks: Vec<PageClock>,
    /// First gfn of the next slice.
    next: u32,
    /// When the next slice is due, µs.
    due_us: u64,
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
    /// A hand for a guest of `pages` pages; its first slice is due at once.
    pub fn new(pages: usize) -> ClockHand {
        ClockHand {
            clocks: vec![PageClock::FRESH; pages],
            next: 0,
            due_us: 0,
            counting: [0; 4],
            last_pass: [0; 4],
            passes: 0,
            scan_marks: [u64::MAX; 8],
            applied_pass: 0,
        }
    }

    /// The next slice `(first gfn, pages)` if it is due at `now_us`; a pass over the
    /// guest is spread evenly over `interval_us`.
    pub fn due_slice(&mut self, now_us: u64, interval_us: u64) -> Option<(u32, u32)> {
        if now_us < self.due_us {
            return None;
        }
        let pages = self.clocks.len() as u32;
        let slices = pages.div_ceil(CLOCK_SLICE).max(1);
        let period = interval_us / slices as u64;
        // A hand that fell behind (a busy daemon) restarts its rhythm from now.
        self.due_us = (self.due_us + period).max(now_us);
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

/// What a policy lets the engine do with a page in a given class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Actions {
    /// Share it with an identical page (or reclaim it if zero).
    pub share: bool,
    /// Index it as a reference page for patching others.
    pub reference: bool,
    /// Store it as a patch against a similar page.
    pub patch: bool,
    /// Compress it.
    pub compress: bool,
    /// Swap it out when host memory is over budget.
    pub swap: bool,
}

impl Actions {
    const NONE: Actions = Actions {
        share: false,
        reference: false,
        patch: false,
        compress: false,
        swap: false,
    };
}

/// Which mechanisms may touch pages of each class (DE §4.2: "a clean separation between
/// mechanism and policy").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Policy {
    /// Name for reports.
    pub name: &'static str,
    /// Actions for C1, C2, C3, C4.
    pub actions: [Actions; 4],
}

impl Policy {
    /// DE §4.2's default: C1 ignored; C2 shared or used as reference; C3 shared or patched
    /// (and usable as reference); C4 anything, including compression and swap.
    pub fn difference_engine() -> Self {
        let c2 = Actions {
            share: true,
            reference: true,
            ..Actions::NONE
        };
        let c3 = Actions { patch: true, ..c2 };
        let c4 = Actions {
            compress: true,
            swap: true,
            ..c3
        };
        Policy {
            name: "de",
            actions: [Actions::NONE, c2, c3, c4],
        }
    }

    /// Sharing only, what ESX and KSM do: identical pages shared once their content has
    /// been stable for a scan (C2–C4; like KSM's unstable-tree checksum rule), swap in C4.
    pub fn sharing_only() -> Self {
        let s = Actions {
            share: true,
            ..Actions::NONE
        };
        Policy {
            name: "sharing",
            actions: [Actions::NONE, s, s, Actions { swap: true, ..s }],
        }
    }

    /// DE's "more aggressive" alternative: every page treated as C4.
    pub fn aggressive() -> Self {
        let c4 = Policy::difference_engine().actions[3];
        Policy {
            name: "aggressive",
            actions: [c4; 4],
        }
    }

    /// Only one mechanism, for the micro-benchmarks of DE §5.3 (each mechanism alone):
    /// `"share"`, `"patch"` or `"compress"`, allowed from C2 on for sharing and C3/C4 for
    /// the others as in the default policy. Returns `None` for another name.
    pub fn single(mechanism: &str) -> Option<Self> {
        let de = Policy::difference_engine();
        let mut p = Policy {
            name: "",
            actions: [Actions::NONE; 4],
        };
        for (i, a) in de.actions.iter().enumerate() {
            p.actions[i] = match mechanism {
                "share" => Actions {
                    share: a.share,
                    ..Actions::NONE
                },
                "patch" => Actions {
                    patch: a.patch,
                    reference: a.reference,
                    ..Actions::NONE
                },
                "compress" => Actions {
                    compress: a.compress,
                    ..Actions::NONE
                },
                _ => return None,
            };
        }
        p.name = match mechanism {
            "share" => "share-only",
            "patch" => "patch-only",
            _ => "compress-only",
        };
        Some(p)
    }

    /// Every policy name [`Policy::by_name`] knows.
    pub const NAMES: [&'static str; 6] = [
        "de",
        "sharing",
        "aggressive",
        "share-only",
        "patch-only",
        "compress-only",
    ];

    /// Looks a policy up by name (one of [`Policy::NAMES`]).
    pub fn by_name(name: &str) -> Option<Self> {
        match name {
            "de" => Some(Self::difference_engine()),
            "sharing" => Some(Self::sharing_only()),
            "aggressive" => Some(Self::aggressive()),
            n => n.strip_suffix("-only").and_then(Self::single),
        }
    }

    /// The actions for a class.
    pub fn for_state(&self, s: NruState) -> Actions {
        self.actions[s.index()]
    }

    /// Whether the policy patches, compresses or indexes reference pages, which it does
    /// only to pages the NRU clock has classified (sharing alone runs without it).
    pub fn needs_clock(&self) -> bool {
        self.actions
            .iter()
            .any(|a| a.reference || a.patch || a.compress)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_follow_the_paper() {
        let mut c = PageClock::FRESH;
        assert_eq!(c.scan(), NruState::C1, "just written");
        assert_eq!(c.scan(), NruState::C3, "idle for one scan");
        assert_eq!(c.scan(), NruState::C4, "idle in consecutive scans");
        assert_eq!(c.scan(), NruState::C4);
        c.touch(false);
        assert_eq!(c.state(), NruState::C2);
        assert_eq!(c.scan(), NruState::C2, "read, not written");
        assert_eq!(c.idle_scans(), 0);
        assert_eq!(c.scan(), NruState::C3, "an access resets the idle count");
        c.touch(true);
        assert_eq!(c.scan(), NruState::C1);
        for _ in 0..20 {
            c.scan();
        }
        assert_eq!(c.idle_scans(), 7, "saturates");
        c.observe(false, true);
        assert_eq!(c.state(), NruState::C1);
    }

    #[test]
    fn last_state_is_what_the_last_scan_found() {
        let mut c = PageClock::FRESH;
        assert_eq!(
            c.last_state(),
            NruState::C2,
            "not scanned yet: no known class"
        );
        assert_eq!(c.scan(), NruState::C1);
        assert_eq!(c.last_state(), NruState::C1);
        c.touch(false);
        assert_eq!(
            c.last_state(),
            NruState::C1,
            "bits since the scan wait for the next"
        );
        assert_eq!(c.scan(), NruState::C2);
        assert_eq!(c.last_state(), NruState::C2);
        for want in [NruState::C3, NruState::C4, NruState::C4] {
            assert_eq!(c.scan(), want);
            assert_eq!(c.last_state(), want);
        }
        for _ in 0..20 {
            c.scan();
        }
        assert_eq!(c.idle_scans(), 7);
        assert_eq!(c.last_state(), NruState::C4);
        c = PageClock::WRITTEN;
        assert_eq!(c.last_state(), NruState::C1);
        assert_eq!(c.idle_scans(), 0);
        assert_eq!(c.scan(), NruState::C1, "written counts as modified");
        assert_eq!(c.scan(), NruState::C3);
        assert_eq!(c.last_state(), NruState::C3);
    }

    #[test]
    fn policies() {
        let de = Policy::difference_engine();
        assert_eq!(de.for_state(NruState::C1), Actions::default());
        let c2 = de.for_state(NruState::C2);
        assert!(c2.share && c2.reference && !c2.patch && !c2.compress);
        let c3 = de.for_state(NruState::C3);
        assert!(c3.share && c3.patch && !c3.compress && !c3.swap);
        let c4 = de.for_state(NruState::C4);
        assert!(c4.share && c4.patch && c4.compress && c4.swap);
        for name in Policy::NAMES {
            assert_eq!(Policy::by_name(name).unwrap().name, name);
        }
        assert!(Policy::by_name("nope").is_none());
        for name in Policy::NAMES {
            let sharing_alone = matches!(name, "sharing" | "share-only");
            assert_eq!(
                Policy::by_name(name).unwrap().needs_clock(),
                !sharing_alone,
                "{name}"
            );
        }
        assert!(!Policy::sharing_only()
            .actions
            .iter()
            .any(|a| a.patch || a.compress));
    }

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
        let t0 = 0u64;
        let iv = 3_000_000u64;
        let mut seen = Vec::new();
        let mut t = t0;
        while seen.len() < 3 {
            if let Some(s) = h.due_slice(t, iv) {
                seen.push(s);
            }
            t += 100_000;
        }
        assert_eq!(
            seen,
            vec![
                (0, CLOCK_SLICE),
                (CLOCK_SLICE, CLOCK_SLICE),
                (2 * CLOCK_SLICE, 5)
            ]
        );
        assert!(t - t0 >= 2_000_000, "slices spread over the interval");
        assert_eq!(
            h.due_slice(t + iv, iv).map(|s| s.0),
            Some(0),
            "wraps around"
        );
    }
}
