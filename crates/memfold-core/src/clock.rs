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

/// One page's clock word: R (bit 0), M (bit 1), the number of consecutive scans that
/// found it idle (bits 2..4, saturating at 7), whether the last scan found it modified
/// (bit 5), whether the agent armed it at its last visit (bit 6), and how many
/// consecutive scans found it used (bits 7..8, saturating at 3); bits 12..15 are a nibble
/// the clock keeps for the engine and never reads (`ClockHand::nibble`). DE keeps R/M
/// in the P2M entry and "two additional bits" for C4; we keep a whole idle count so that
/// compression can also wait for a full multi-pass sharing cycle (DE §4.3), the last
/// class so that a mechanism running between scans (the live sharing scan) can ignore C1
/// pages as the policy says, and the used streak so that settled hot pages are re-armed
/// less often ([`ClockHand::arm_mask`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageClock(u16);

const R: u16 = 1;
const M: u16 = 2;
const AGE_SHIFT: u16 = 2;
const AGE_MAX: u16 = 7;
const LAST_M: u16 = 1 << 5;
const ARMED: u16 = 1 << 6;
const HOT_SHIFT: u16 = 7;
const HOT_MAX: u16 = 3;
/// The bits the clock itself uses; the others are kept as they are by every change.
const CLOCK_BITS: u16 = 0x1ff;
const NIBBLE_SHIFT: u16 = 12;

impl PageClock {
    /// A page the clock has not scanned yet: recently modified for its first scan, but
    /// of no known class until then ([`PageClock::last_state`] says C2). It counts as
    /// armed: an agent reports a page it never armed as referenced and modified.
    pub const FRESH: PageClock = PageClock(R | M | ARMED);

    /// A page just written where the clock could not see it (a CoW break, a refill of a
    /// reclaimed page, a page decoded back): C1 until a scan finds otherwise.
    pub const WRITTEN: PageClock = PageClock(R | M | LAST_M);

    /// Whether the agent armed the page at its clock slice's last visit, so that the R
    /// and M bits of this visit are an observation (a page left unarmed takes no fault
    /// and reports nothing).
    pub fn armed(self) -> bool {
        self.0 & ARMED != 0
    }

    /// Consecutive scans that found the page used (C1 or C2), up to 3.
    pub fn used_streak(self) -> u8 {
        ((self.0 >> HOT_SHIFT) & HOT_MAX) as u8
    }

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
        ((self.0 >> AGE_SHIFT) & AGE_MAX) as u8
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
        let (age, hot) = if idle {
            ((self.idle_scans() as u16 + 1).min(AGE_MAX), 0)
        } else {
            (0, (self.used_streak() as u16 + 1).min(HOT_MAX))
        };
        self.0 = age << AGE_SHIFT | hot << HOT_SHIFT | (self.0 & (R | M | ARMED | !CLOCK_BITS));
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
    /// Per gfn: the page's clock word, with the engine's nibble in its spare bits.
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
    /// Per slice sent and not answered yet: (first gfn, the pages it arms).
    pending: Vec<(u32, Vec<u64>)>,
}

/// Settled hot pages are re-armed in groups of this many consecutive pages (2 MiB), so
/// that the agent's write-protect and zap calls still cover long runs.
const REARM_GROUP: u32 = 512;

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
            pending: Vec::new(),
        }
    }

    /// Which pages of the slice `[first, first + count)` the agent should arm at this
    /// visit (bit k of word k/64 for gfn `first + k`), remembered until the slice's bits
    /// come back ([`ClockHand::apply`]).
    ///
    /// Arming costs a fault per page the guest then uses, every pass; a page used in
    /// every scan costs one each pass and tells nothing new. So a page found used in 2
    /// consecutive observed scans is armed every `min(4, max_period)` passes only, and
    /// after 3 every `max_period` passes (DE §4.2 leaves the sampling to the
    /// implementation; the kernel's MGLRU likewise walks hot regions less often). A page
    /// left unarmed is not observed at its next visit: it keeps its class, so it only
    /// becomes C3/C4 — what patching, compression and swap may take — after an armed,
    /// observed, idle interval. Every other page (idle, just changed, never scanned) is
    /// armed at every visit. `max_period` 1 arms every page at every visit.
    pub fn arm_mask(&mut self, first: u32, count: u32, max_period: u32) -> Vec<u64> {
        let end = first.saturating_add(count).min(self.clocks.len() as u32);
        let n = end.saturating_sub(first);
        let mut mask = vec![0u64; (n as usize).div_ceil(64)];
        let max_period = max_period.max(1) as u64;
        for g in first..end {
            let period = match self.clocks[g as usize].used_streak() {
                0 | 1 => 1,
                2 => max_period.min(4),
                _ => max_period,
            };
            if (self.passes + (g / REARM_GROUP) as u64) % period == 0 {
                let k = (g - first) as usize;
                mask[k / 64] |= 1 << (k % 64);
            }
        }
        self.pending.retain(|&(f, _)| f != first);
        self.pending.push((first, mask.clone()));
        mask
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
    /// private page (`private(gfn)`) the agent armed at the last visit is observed and
    /// scanned, one left unarmed keeps its class; at the end of the guest's RAM the
    /// pass's class counts become [`ClockHand::last_pass`]. The private pages this
    /// visit's [`ClockHand::arm_mask`] named are armed from now on (none, if the slice
    /// was not asked for by this hand). `full_scans` is memfoldd's count of full sharing
    /// scans started (see [`ClockHand::seen_by_sharing`]).
    pub fn apply(
        &mut self,
        first: u32,
        count: u32,
        referenced: &[u64],
        modified: &[u64],
        full_scans: u64,
        private: impl Fn(u32) -> bool,
    ) {
        let end = (first + count).min(self.clocks.len() as u32);
        if first == 0 {
            self.scan_marks[(self.passes % 8) as usize] = full_scans;
        }
        self.applied_pass = self.passes;
        let arms = self
            .pending
            .iter()
            .position(|&(f, _)| f == first)
            .map(|i| self.pending.swap_remove(i).1)
            .unwrap_or_default();
        for g in first..end {
            let k = g - first;
            let c = &mut self.clocks[g as usize];
            if !private(g) {
                c.0 &= !ARMED; // the agent arms private pages only
                continue;
            }
            let state = if c.armed() {
                c.observe(mask_bit(referenced, k), mask_bit(modified, k));
                c.scan()
            } else {
                c.last_state()
            };
            self.counting[state.index()] += 1;
            if mask_bit(&arms, k) {
                // A new observation window: only accesses from now on count.
                c.0 = (c.0 & !(R | M)) | ARMED;
            } else {
                c.0 &= !ARMED;
            }
        }
        if end as usize >= self.clocks.len() {
            self.last_pass = std::mem::take(&mut self.counting);
            self.passes += 1;
        }
    }

    /// Page `gfn`'s clock (R, M, idle scans, ...), without the engine's nibble, so that
    /// words compare as the clock sees them.
    pub fn page(&self, gfn: u32) -> PageClock {
        PageClock(self.clocks[gfn as usize].0 & CLOCK_BITS)
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

    /// A disk read just filled page `gfn` (Satori §4.1): new data the guest asked for and
    /// is about to read, so C2 (referenced, not idle) until its next scan, whatever it
    /// was before; what the agent saw of it meanwhile (M, if it was armed) still counts.
    pub fn landed(&mut self, gfn: u32) {
        if let Some(c) = self.clocks.get_mut(gfn as usize) {
            *c = PageClock(R | (c.0 & (ARMED | M | !CLOCK_BITS)));
        }
    }

    /// A page that became private again by a write or an access the clock could not see
    /// (CoW break, refill, decode back) is C1 until its next scan ([`PageClock::WRITTEN`]);
    /// if it was armed, the agent's bits include the access, so it stays armed.
    pub fn fresh(&mut self, gfn: u32) {
        if let Some(c) = self.clocks.get_mut(gfn as usize) {
            *c = PageClock(PageClock::WRITTEN.0 | (c.0 & (ARMED | !CLOCK_BITS)));
        }
    }

    /// Page `gfn`'s nibble (0–15): four bits of each page's clock word the clock does not
    /// use and no change of the clock touches, lent to the engine so that a per-page
    /// hint it needs only while a page is out of the clock's hands costs no array of its
    /// own (the unmapped ages, `engine/unmapped/ages.rs`; issue 19: 0.5 bytes a page).
    pub(crate) fn nibble(&self, gfn: u32) -> u8 {
        (self.clocks[gfn as usize].0 >> NIBBLE_SHIFT) as u8
    }

    /// Sets page `gfn`'s nibble to `v` (the low four bits of it).
    pub(crate) fn set_nibble(&mut self, gfn: u32, v: u8) {
        let c = &mut self.clocks[gfn as usize];
        c.0 = (c.0 & !(0xf << NIBBLE_SHIFT)) | (u16::from(v & 0xf) << NIBBLE_SHIFT);
    }

    /// Sets to 0 every nibble not 0 that `keep` refuses, in one pass over the pages;
    /// returns how many nibbles are not 0 after it.
    pub(crate) fn retain_nibbles(&mut self, keep: impl Fn(u8) -> bool) -> u64 {
        let mut left = 0;
        for c in &mut self.clocks {
            let v = (c.0 >> NIBBLE_SHIFT) as u8;
            if v == 0 {
                continue;
            }
            if keep(v) {
                left += 1;
            } else {
                c.0 &= !(0xf << NIBBLE_SHIFT);
            }
        }
        left
    }
}

/// Bit `k` of a page mask: bit k of word k/64 (the clock's R, M and arm masks); words
/// missing from the end read as 0.
pub(crate) fn mask_bit(words: &[u64], k: u32) -> bool {
    words
        .get(k as usize / 64)
        .is_some_and(|w| w >> (k % 64) & 1 == 1)
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

    /// The engine's nibble (bits 12..15) goes through every change of the clock untouched
    /// and changes nothing the clock decides: two hands driven alike, one with nibbles
    /// set, classify alike and keep the nibbles.
    #[test]
    fn a_page_s_nibble_survives_every_clock_change_and_changes_no_class() {
        let pages = 300u32;
        let (mut plain, mut lent) = (
            ClockHand::new(pages as usize),
            ClockHand::new(pages as usize),
        );
        for g in (0..pages).step_by(7) {
            lent.set_nibble(g, (g % 15) as u8 + 1);
        }
        let words =
            |h: &ClockHand| -> Vec<u16> { (0..pages).map(|g| h.page(g).0 & CLOCK_BITS).collect() };
        for pass in 0..12u64 {
            for h in [&mut plain, &mut lent] {
                h.arm_mask(0, pages, 4);
                // Every third page read, every fifth written, changing with the pass.
                let bits = |m: u64| -> Vec<u64> {
                    let mut w = vec![0u64; (pages as usize).div_ceil(64)];
                    for g in 0..pages as u64 {
                        if (g + pass) % m == 0 {
                            w[g as usize / 64] |= 1 << (g % 64);
                        }
                    }
                    w
                };
                h.apply(0, pages, &bits(3), &bits(5), pass, |g| g % 11 != 0);
                h.landed((pass * 13 % pages as u64) as u32);
                h.fresh((pass * 17 % pages as u64) as u32);
            }
            assert_eq!(words(&plain), words(&lent), "pass {pass}");
            assert_eq!(plain.last_pass, lent.last_pass, "pass {pass}");
        }
        for g in 0..pages {
            let want = if g % 7 == 0 { (g % 15) as u8 + 1 } else { 0 };
            assert_eq!(lent.nibble(g), want, "gfn {g}");
            assert_eq!(plain.nibble(g), 0);
        }
        assert_eq!(
            lent.retain_nibbles(|v| v % 2 == 0),
            (0..pages)
                .step_by(7)
                .filter(|g| (g % 15 + 1) % 2 == 0)
                .count() as u64
        );
        assert!((0..pages).all(|g| lent.nibble(g) % 2 == 0));
        assert_eq!(
            words(&plain),
            words(&lent),
            "a sweep leaves the clock alone"
        );
    }

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
            h.arm_mask(0, pages, 1);
            h.apply(0, pages, &r, &m, pass as u64 * 2, |g| g != 99);
            // Idle pages went idle in pass 1; the scan that started after pass 2 began
            // has finished once a later one started.
            assert_eq!(h.seen_by_sharing(5, pass as u64 * 2 + 2), pass >= 1);
            assert!(!h.seen_by_sharing(0, u64::MAX - 2), "written every pass");
            assert_eq!(h.passes, pass as u64 + 1);
            assert_eq!(&h.last_pass, want, "pass {}", pass + 1);
        }
    }

    /// A page used in every scan is armed every 4th pass after 2 used scans and every
    /// `max`th after 3; one left unarmed keeps its class (its zero bits are no
    /// observation), an idle page is armed every pass, and a page that goes idle is
    /// found idle at its next armed visit.
    #[test]
    fn settled_hot_pages_are_armed_less_often() {
        let pages = 2 * REARM_GROUP;
        let mut h = ClockHand::new(pages as usize);
        let words = (pages as usize).div_ceil(64);
        let hot = |g: u32| g % 2 == 0;
        let mut armed_hot = Vec::new();
        let mut armed = vec![true; pages as usize]; // FRESH counts as armed
        let mut hot_stops = false;
        for pass in 0..40u64 {
            // The guest uses every even page (until pass 30), while armed only: an
            // unarmed page takes no fault and reports nothing.
            let mut r = vec![0u64; words];
            for g in (0..pages).filter(|&g| hot(g) && armed[g as usize] && !hot_stops) {
                r[g as usize / 64] |= 1 << (g % 64);
            }
            let mask = h.arm_mask(0, pages, 16);
            h.apply(0, pages, &r, &r, pass, |_| true);
            let bit = |g: u32| mask_bit(&mask, g);
            for g in 0..pages {
                armed[g as usize] = bit(g);
                if !hot(g) && pass > 0 {
                    assert!(bit(g), "idle page {g} armed every pass");
                }
                if hot(g) && !hot_stops {
                    assert_eq!(h.page(g).last_state(), NruState::C1, "pass {pass} page {g}");
                }
            }
            armed_hot.push((0..pages).filter(|&g| hot(g) && bit(g)).count());
            hot_stops |= pass == 29;
        }
        let half = pages as usize / 2;
        // FRESH and the next scan see it used; from its third scan on (used 3 times) each
        // 2 MiB group is armed one pass in 16, the groups in different passes.
        assert_eq!(&armed_hot[..3], &[half, half, 0]);
        assert_eq!(
            armed_hot[3..19].iter().sum::<usize>(),
            half,
            "once in 16 passes"
        );
        assert_eq!(armed_hot[3..19].iter().filter(|&&n| n > 0).count(), 2);
        // The guest stops using them at pass 30: each group's next armed visit finds it
        // idle, and from then on it is armed every pass.
        assert!(armed_hot[34..].iter().all(|&n| n == half), "{armed_hot:?}");
        let idle_hot = (0..pages).filter(|&g| hot(g) && h.page(g).last_state() >= NruState::C3);
        assert_eq!(idle_hot.count(), half, "found idle within 16 + 2 passes");
        let c = h.page(0);
        assert!(c.armed() && c.used_streak() == 0);
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
