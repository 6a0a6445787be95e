//! The engine's hints about each guest page, one byte a page (issue 19: ESX §4.3 keeps
//! page sharing metadata under 0.5% of memory). They were four arrays — the scan's quiet
//! age (a byte), DE's re-store wait (a byte) and two bitmaps — 2.25 bytes a page; packed:
//!
//! | bits | what | values |
//! |---|---|---|
//! | 0–3 | the sharing scan's quiet age ([`super::scan`]): full scans in a row that read the page and found nothing | 0–15, saturating (the scan's longest period starts at age 8) |
//! | 4–5 | the re-store back-off (DE §4.2 as built here, `Engine::restash_after`): idle clock scans a page taken back soon must wait before it is stored again | 0, 2, 4 or 7 scans |
//! | 6 | neither a patch nor compression came under the cut-off when last tried (DE §4.1) | |
//! | 7 | a page-out asked of the agent and not answered yet (issue 15, [`super::kernel_swap`]) | |
//!
//! All are hints: none decides what a guest reads (the agent checks bytes under
//! write-protection whatever the engine believes), only when a page is read or tried.

use crate::ids::Gfn;

const AGE: u8 = 0x0f;
const WAIT_SHIFT: u8 = 4;
const WAIT: u8 = 0x3 << WAIT_SHIFT;
const DE_FAILED: u8 = 1 << 6;
const PAGE_OUT_GOING: u8 = 1 << 7;

/// The re-store wait of each back-off level, idle clock scans: none, then 2, 4, 7 (each
/// take-back soon after a store doubles the last, at most 7: the clock's idle count
/// saturates there).
const WAITS: [u8; 4] = [0, 2, 4, 7];

/// One byte of hints a guest page (the module's table).
pub(crate) struct PageHints(Vec<u8>);

impl PageHints {
    /// `pages` pages: age 0, no wait, untried, no page-out going.
    pub(crate) fn new(pages: usize) -> Self {
        PageHints(vec![0; pages])
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.0.capacity()
    }

    /// Page `g`'s quiet age, full scans (saturating at 15).
    pub(crate) fn scan_age(&self, g: u32) -> u8 {
        self.0[g as usize] & AGE
    }

    /// Page `g` was read by the sharing scan and nothing found: one scan older.
    pub(crate) fn age_up(&mut self, g: u32) {
        let b = &mut self.0[g as usize];
        if *b & AGE < AGE {
            *b += 1;
        }
    }

    /// Page `g` led to a request (share, reclaim) or changed: age 0, read in every scan.
    /// Pages past the guest's end are ignored.
    pub(crate) fn age_reset(&mut self, g: Gfn) {
        if let Some(b) = self.0.get_mut(g.index()) {
            *b &= !AGE;
        }
    }

    /// Idle clock scans page `g` waits before it is stored again (0, 2, 4 or 7).
    pub(crate) fn restash_wait(&self, g: Gfn) -> u8 {
        WAITS[((self.0[g.index()] & WAIT) >> WAIT_SHIFT) as usize]
    }

    /// Page `g` was taken back: after a long life its wait ends (`lived_long`), else it
    /// doubles (2, 4, then 7 scans).
    pub(crate) fn restash_after(&mut self, g: Gfn, lived_long: bool) {
        let b = &mut self.0[g.index()];
        let level = (*b & WAIT) >> WAIT_SHIFT;
        let level = if lived_long { 0 } else { (level + 1).min(3) };
        *b = (*b & !WAIT) | (level << WAIT_SHIFT);
    }

    /// Whether neither a patch nor compression fitted page `g` when last tried.
    pub(crate) fn de_failed(&self, g: Gfn) -> bool {
        self.0[g.index()] & DE_FAILED != 0
    }

    /// Sets whether neither a patch nor compression fitted page `g`.
    pub(crate) fn set_de_failed(&mut self, g: Gfn, failed: bool) {
        set(&mut self.0[g.index()], DE_FAILED, failed);
    }

    /// Whether a page-out of page `g` was asked and not answered yet.
    pub(crate) fn page_out_going(&self, g: Gfn) -> bool {
        self.0[g.index()] & PAGE_OUT_GOING != 0
    }

    /// Marks a page-out of page `g` asked.
    pub(crate) fn set_page_out_going(&mut self, g: Gfn) {
        set(&mut self.0[g.index()], PAGE_OUT_GOING, true);
    }

    /// Ends the page-out of page `g` under way, if there is one; returns whether there
    /// was ([`super::kernel_swap`]).
    pub(crate) fn take_page_out_going(&mut self, g: Gfn) -> bool {
        let b = &mut self.0[g.index()];
        let going = *b & PAGE_OUT_GOING != 0;
        *b &= !PAGE_OUT_GOING;
        going
    }
}

fn set(b: &mut u8, bit: u8, on: bool) {
    if on {
        *b |= bit;
    } else {
        *b &= !bit;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_s_hints_take_one_byte_and_do_not_disturb_each_other() {
        let mut h = PageHints::new(3);
        assert_eq!(h.bytes(), 3);
        let g = Gfn(1);
        for _ in 0..40 {
            h.age_up(1);
        }
        assert_eq!(h.scan_age(1), 15, "saturates");
        h.set_de_failed(g, true);
        h.set_page_out_going(g);
        let waits: Vec<u8> = (0..5)
            .map(|_| {
                h.restash_after(g, false);
                h.restash_wait(g)
            })
            .collect();
        assert_eq!(waits, [2, 4, 7, 7, 7], "as (w * 2).clamp(2, 7) was");
        assert_eq!(h.scan_age(1), 15);
        assert!(h.de_failed(g) && h.page_out_going(g));
        h.age_reset(g);
        assert_eq!((h.scan_age(1), h.restash_wait(g)), (0, 7));
        h.restash_after(g, true);
        assert_eq!(h.restash_wait(g), 0);
        assert!(h.take_page_out_going(g) && !h.take_page_out_going(g));
        assert!(h.de_failed(g));
        h.set_de_failed(g, false);
        assert!(!h.de_failed(g));
        // The neighbours never moved.
        for n in [Gfn(0), Gfn(2)] {
            assert_eq!((h.scan_age(n.0), h.restash_wait(n)), (0, 0));
            assert!(!h.de_failed(n) && !h.page_out_going(n));
        }
        h.age_reset(Gfn(99)); // past the end: ignored
    }

    /// The engine's per-page cost, as `metadata_by().pages` counts it: the P2M entry (4
    /// bytes), the clock (2, with the unmapped pages' epoch nibble in its spare bits,
    /// `unmapped::UnmappedAges`), the hints (1). 8.25 bytes before the hints were packed,
    /// 7.5 while the nibbles were an array of their own.
    #[test]
    fn a_guest_page_costs_the_engine_seven_bytes() {
        const PAGES: u32 = 1 << 16;
        let r = crate::sim::Rig::new(
            crate::sim::quick_config(crate::Policy::difference_engine()),
            PAGES,
        )
        .unwrap();
        let pages = r.engine.metadata_by().pages;
        assert_eq!(
            pages,
            7 * PAGES as u64,
            "{} bytes a page",
            pages as f64 / PAGES as f64
        );
    }
}
