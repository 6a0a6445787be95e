//! The sharing scan (ESX §4.3): guest pages are read (holes skipped, so nothing is
//! faulted in), hashed and looked up in the share table; a match with a shared frame or
//! a hint is confirmed byte for byte, then the agent is asked to map the page onto the
//! frame. Scanning is rate-limited in pages/s; hints are dropped after each full scan,
//! and a quiet full scan doubles the time to the next one. Zero pages are reclaimed,
//! shared onto one zero frame, or kept, as the [`ZeroPolicy`] says.
//!
//! Quiet pages are read less often (as Linux KSM's "smart scan", on by default since
//! 6.7, skips pages that did not merge): a page read and found neither zero nor equal
//! to another page ages by one scan; from age 3 on it is read only in every 2nd full
//! scan, from age 5 every 4th, from age 8 every 8th (at most
//! [`EngineConfig::quiet_scan_period`]). A page the scan asks to share or reclaim
//! starts again at age 0. Periods are powers of two counted from the same full scan, so
//! all pages are read together in every 8th scan and any two quiet pages still meet
//! (a hint lasts one full scan); a duplicate made meanwhile is found up to that many
//! scans later. Every page is read in each of its first 3 scans, when the bulk of the
//! sharing is found.
//!
//! With [`EngineConfig::share_passes`] over 1 (DE §4.3's passes), a quiet page is hinted
//! only in the scans whose hash interval holds its hash; a page not yet quiet, in every
//! scan. Shared frames stay in the share table in every scan.
//!
//! [`EngineConfig::quiet_scan_period`]: super::EngineConfig::quiet_scan_period
//! [`EngineConfig::share_passes`]: super::EngineConfig::share_passes

use super::unmapped::{Found, Identical, Seen};
use super::{Command, Engine, EngineError, ZeroPolicy};
use crate::categories::{Category, CategorySet};
use crate::ids::{Gfn, VmId};
use crate::p2m::PageState;
use crate::share::ShareEntry;
use crate::{is_zero_page, Page, PAGE_SIZE};

/// Pages read at a time.
pub(crate) const READ_PAGES: usize = 64;

/// The quiet age from which a page rests in some scans, and is hinted only in its hash
/// interval's scans ([`super::EngineConfig::share_passes`]).
const QUIET_AGE: u8 = 3;

/// Full scans between two reads of a page that the scan has read `age` times in a row
/// with nothing found (a ladder like KSM's `skip_age`), at most `max`: every scan below
/// age 3, then every 2nd, 4th, and from age 8 every 8th.
fn period(age: u8, max: u32) -> u64 {
    let p: u32 = match age {
        0..QUIET_AGE => 1,
        3..=4 => 2,
        5..=7 => 4,
        _ => 8,
    };
    p.min(max).max(1) as u64
}

/// Whether a page of quiet age `age` rests in full scan number `pass`: its period does
/// not divide `pass`. Periods are powers of two, so every page is read in each scan whose
/// number is a multiple of the longest period: any two quiet pages meet there (hints last
/// one full scan). The age lives in the page's hints ([`super::page_hints`]).
fn rests(age: u8, pass: u64, max: u32) -> bool {
    pass % period(age, max) != 0
}

/// What the sharing scan does with a resident page in this full scan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Visit {
    /// Read it.
    Read,
    /// Pass over it: quiet, resting in this scan.
    Quiet,
    /// Pass over it: the guest reported it of a skipped category (slab or kernel by
    /// default, PV §3.1).
    Kernel,
    /// Pass over it in this sweep: page cache is read in the first, the rest in the
    /// second.
    OtherSweep,
    /// Pass over it: paged out to the kernel's swap (issue 15), left there.
    PagedOut,
}

impl super::Vm {
    /// What the scan does with page `g` in full scan `pass` (quiet pages' periods at most
    /// `max`), using the guest's categories if `use_cats` and it reported them: pages of
    /// the categories of `skip` are not read.
    fn visit(&self, g: u32, pass: u64, max: u32, use_cats: bool, skip: CategorySet) -> Visit {
        if self.paged_out_or_going(Gfn(g)) {
            // Reading it would swap it back in (issue 15's zswap backing).
            return Visit::PagedOut;
        }
        if let Some(m) = self.categories.as_ref().filter(|_| use_cats) {
            let c = m.category(Gfn(g));
            if skip.contains(c) {
                // Counted once a full scan, in its second sweep.
                return if self.sweep == 0 {
                    Visit::OtherSweep
                } else {
                    Visit::Kernel
                };
            }
            if (c == Category::Cache) != (self.sweep == 0) {
                return Visit::OtherSweep;
            }
        }
        if rests(self.hints.scan_age(g), pass, max) {
            Visit::Quiet
        } else {
            Visit::Read
        }
    }

    /// Books page `g`, which the scan passes over as `passed`, as skipped: quiet pages and
    /// pages of a skipped category are counted if they hold data — `in_run` (a page of a
    /// data run the memfd named) or else by the books (the guest's own or in flight, not a
    /// hole memfold punched: zero, shared, stored, moving or unmapped), as the scan passes
    /// pages before asking where data lies and does not know what the memfd holds there.
    /// A page never written, or discarded by the guest while private, is then counted too.
    fn pass_over(&mut self, g: u32, passed: Visit, in_run: bool) {
        let data = in_run
            || !matches!(
                self.state(Gfn(g)),
                PageState::Zero
                    | PageState::Shared(_)
                    | PageState::Stored(_)
                    | PageState::Moving(_)
                    | PageState::Unmapped(_)
            );
        match passed {
            Visit::Quiet if data => self.books.skipped_pages += 1,
            Visit::Kernel if data => self.books.category_skipped += 1,
            _ => {}
        }
    }

    /// The cursor reached the end of its RAM: with categories in use, the first sweep
    /// (page cache) is followed by the second (the rest) from gfn 0; else its part of the
    /// full scan is done. Returns whether it is.
    fn end_sweep(&mut self, use_cats: bool) -> bool {
        if use_cats && self.categories.is_some() && self.sweep == 0 {
            self.sweep = 1;
            self.cursor = 0;
            self.run_end = 0;
            false
        } else {
            self.end_scan_part();
            true
        }
    }
}

/// The scan's progress and pacing.
pub(crate) struct ScanState {
    /// Full scans started.
    pub(crate) full_scans: u64,
    pass_started_us: u64,
    /// Current time between full scans, µs.
    interval_us: u64,
    /// Pages read and requests made since the current full scan started.
    pass_read: u64,
    pub(crate) pass_requests: u64,
    /// When pool frames were last paged out (`Engine::page_out_frames`), µs.
    pub(crate) frames_paged_out_us: u64,
    /// Rate limiter: pages that may be read, and when it was last filled.
    tokens: f64,
    last_us: u64,
    /// The read buffer, [`READ_PAGES`] pages (kept: not allocated and zeroed each step).
    buf: Vec<u8>,
}

impl ScanState {
    pub(crate) fn new(now_us: u64) -> Self {
        ScanState {
            full_scans: 0,
            pass_started_us: now_us,
            frames_paged_out_us: now_us,
            interval_us: 0,
            pass_read: 0,
            pass_requests: 0,
            tokens: 0.0,
            last_us: now_us,
            buf: vec![0u8; READ_PAGES * PAGE_SIZE],
        }
    }
}

impl Engine {
    /// One step of the sharing scan: up to the pages the rate limit allows since the last
    /// step (4096 at full speed), round-robin over attached guests. Returns whether the
    /// scan is busy (false while no guest is attached or the next full scan waits).
    ///
    /// Errors: [`EngineError::Pool`] if a pool frame cannot be read.
    pub fn scan_step(&mut self) -> Result<bool, EngineError> {
        let now = self.now_us();
        let idle = !self.vms.values().any(|v| v.attached) || self.pass_done_waiting(now);
        let s = &mut self.scan;
        let dt = now.saturating_sub(s.last_us) as f64 / 1e6;
        s.last_us = now;
        let rate = self.cfg.rate as f64;
        let budget = if self.cfg.rate == 0 {
            4096
        } else {
            s.tokens = (s.tokens + dt * rate).min(rate / 10.0 + 64.0);
            let b = s.tokens as u32;
            s.tokens -= b as f64;
            b
        };
        if !idle && budget > 0 {
            self.scan(budget)?;
        }
        Ok(!idle)
    }

    /// Whether every attached guest has been scanned in this full scan and the next one
    /// must wait; starts the next one when it is time.
    fn pass_done_waiting(&mut self, now: u64) -> bool {
        let all_done = self
            .vms
            .values()
            .filter(|v| v.attached && !v.opted_out)
            .all(|v| v.scanned_this_pass);
        if self.vms.is_empty() || !all_done {
            return false;
        }
        let (min, max) = (self.cfg.min_scan_interval_us, self.cfg.max_scan_interval_us);
        let s = &mut self.scan;
        if s.pass_read > 0 {
            // A quiet scan doubles the interval (saving CPU at the plateau), a busy one
            // resets it (detecting new sharing quickly).
            s.interval_us = if s.pass_requests * 1000 < s.pass_read {
                (s.interval_us * 2).min(max)
            } else {
                min
            };
            s.pass_read = 0;
            s.pass_requests = 0;
        }
        s.interval_us = s.interval_us.max(min);
        if now.saturating_sub(s.pass_started_us) < s.interval_us {
            return true;
        }
        // Start the next full scan: hints from the last one are stale (ESX §4.3) — but
        // pages disk reads landed lately and pairs left to the clock keep theirs
        // (`at_read::KEPT_HINTS`).
        for dom in self.domains.values_mut() {
            dom.share.end_pass();
        }
        self.restore_kept_hints();
        self.page_out_frames(now);
        let s = &mut self.scan;
        s.full_scans += 1;
        s.pass_started_us = now;
        for v in self.vms.values_mut() {
            v.scanned_this_pass = false;
        }
        false
    }

    /// Scans up to `budget` pages, round-robin over guests not yet scanned in this pass.
    fn scan(&mut self, budget: u32) -> Result<(), EngineError> {
        let ids: Vec<VmId> = self
            .vms
            .iter()
            .filter(|(_, v)| v.attached && !v.opted_out && !v.scanned_this_pass)
            .map(|(id, _)| *id)
            .collect();
        if ids.is_empty() {
            return Ok(());
        }
        let share = (budget / ids.len() as u32).max(READ_PAGES as u32);
        let mut buf = std::mem::take(&mut self.scan.buf);
        let r = self.scan_guests(&ids, share, budget, &mut buf);
        self.scan.buf = buf;
        r
    }

    /// [`Engine::scan`] over guests `ids`, each given up to `share` of `budget` pages.
    fn scan_guests(
        &mut self,
        ids: &[VmId],
        share: u32,
        mut budget: u32,
        buf: &mut [u8],
    ) -> Result<(), EngineError> {
        for &id in ids {
            let mut mine = share.min(budget);
            while mine > 0 {
                let Some((first, n, asks)) = self.next_chunk(id, mine as usize, buf) else {
                    break;
                };
                // Each ask of where data lies past a chunk's first costs as much as a
                // page read (a dense guest's chunks take one ask at most).
                let cost = (n as u32).saturating_add(asks.saturating_sub(1)).max(1);
                mine = mine.saturating_sub(cost);
                budget = budget.saturating_sub(cost);
                for k in 0..n {
                    let page: &Page = buf[k * PAGE_SIZE..(k + 1) * PAGE_SIZE]
                        .try_into()
                        .expect("a page");
                    self.consider(id, Gfn(first.0 + k as u32), page)?;
                }
            }
        }
        Ok(())
    }

    /// Reads the next run of resident pages of guest `id` from its cursor, leaving out the
    /// quiet pages that rest in this scan; `None` at the end of its RAM (its part of the
    /// full scan is then done). The data run the cursor is in is asked of the guest's RAM
    /// once (`SEEK_DATA`/`SEEK_HOLE` on a memfd walk its pages), not once a chunk. A page
    /// punched out meanwhile reads as zeros: if memfold punched it, it is no longer
    /// private and is passed over; if QEMU discarded it while private (no event tells of
    /// that), it may be reclaimed as a zero page in this scan — correct (it is a hole
    /// either way) but booked as saved, as it would have been before had the discard come
    /// between the ask and the read.
    ///
    /// Returns the chunk's first page, its pages (read into `buf`) and the asks of where
    /// data lies it took. At most `max` asks a call: a chunk of no page is returned when
    /// they run out, so that a guest whose RAM is a sieve of holes, its pages all passed
    /// over (kernel pages it reports, quiet ones), costs memfoldd a step's budget, not a
    /// walk of every data run of its RAM.
    fn next_chunk(&mut self, id: VmId, max: usize, buf: &mut [u8]) -> Option<(Gfn, usize, u32)> {
        let (pass, max_period) = (self.scan.full_scans, self.cfg.quiet_scan_period);
        let (use_cats, skip) = (self.cfg.guest_categories, self.cfg.guest_skip);
        let v = self.vms.get_mut(&id)?;
        if v.scanned_this_pass {
            // Its part of this full scan is done: no page is read twice in one.
            return None;
        }
        let end = v.pages();
        let max = max.clamp(1, READ_PAGES) as u32;
        let mut asks = 0;
        loop {
            if v.cursor >= v.run_end {
                // Pages this scan passes over are passed before asking where data lies, so
                // that the ask is made from a page it reads: a data run holding none is
                // never asked for (issue 15: pages shared, stored and paged out leave guest
                // RAM a sieve of thousands of runs, most of them quiet in a given scan).
                // The same pages are read as when every run was walked: those passed here
                // are read by neither, and from the page asked from the walk goes on as it
                // did (pages between it and the run found are holes).
                while v.cursor < end {
                    match v.visit(v.cursor, pass, max_period, use_cats, skip) {
                        Visit::Read => break,
                        passed => v.pass_over(v.cursor, passed, false),
                    }
                    v.cursor += 1;
                }
                if v.cursor >= end {
                    if v.end_sweep(use_cats) {
                        return None;
                    }
                    continue;
                }
                if asks >= max {
                    return Some((Gfn(v.cursor), 0, asks));
                }
                asks += 1;
                let Some((first, run_end)) = v.ram.next_data_run(Gfn(v.cursor), Gfn(end)) else {
                    if v.end_sweep(use_cats) {
                        return None;
                    }
                    continue;
                };
                v.cursor = first.0;
                v.run_end = run_end.0.min(end).max(first.0 + 1);
            }
            // Quiet pages resting in this scan, pages the guest says are kernel's, and
            // pages of the other sweep are passed over.
            while v.cursor < v.run_end {
                match v.visit(v.cursor, pass, max_period, use_cats, skip) {
                    Visit::Read => break,
                    // In a data run: resident, whatever the books say.
                    passed => v.pass_over(v.cursor, passed, true),
                }
                v.cursor += 1;
            }
            if v.cursor >= v.run_end {
                if v.cursor >= end && v.end_sweep(use_cats) {
                    return None;
                }
                continue;
            }
            let first = v.cursor;
            let mut n = 1;
            while n < max
                && first + n < v.run_end
                && v.visit(first + n, pass, max_period, use_cats, skip) == Visit::Read
            {
                n += 1;
            }
            let n_us = n as usize;
            if v.ram
                .read(Gfn(first), &mut buf[..n_us * PAGE_SIZE])
                .is_err()
            {
                v.end_scan_part();
                return None;
            }
            v.cursor = first + n;
            v.books.scanned_pages += n as u64;
            self.scan.pass_read += n as u64;
            if v.cursor >= end {
                v.end_sweep(use_cats);
            }
            return Some((Gfn(first), n_us, asks));
        }
    }

    /// Whether the policy lets the sharing scan touch page `g` in the class the clock's
    /// last scan found (DE §4.2: C1 pages are ignored, so pages the guest is writing are
    /// not shared only to be CoW-broken). Without the clock, every page.
    pub(crate) fn class_allows_share(&self, id: VmId, g: Gfn) -> bool {
        self.cfg.clock_interval_us.is_none()
            || self.vms.get(&id).is_some_and(|v| {
                self.cfg
                    .policy
                    .for_state(v.clock.page(g.0).last_state())
                    .share
            })
    }

    /// One scanned page: reclaim it if zero, share it with a frame or a hint, or leave a
    /// hint.
    fn consider(&mut self, id: VmId, g: Gfn, page: &Page) -> Result<(), EngineError> {
        self.consider_seen(id, g, page, Seen::Scan);
        Ok(())
    }

    /// Private page `g` of guest `id` holding `page`, as `seen` found it: reclaimed if
    /// zero, shared with a frame or a hinted page, or left as a hint (C1 pages are left
    /// alone, as the policy says). Returns what was found ([`Found::Acted`] also for a
    /// zero page reclaimed).
    pub(crate) fn consider_seen(&mut self, id: VmId, g: Gfn, page: &Page, seen: Seen) -> Found {
        if !self.sharable(id, g) {
            return Found::Nothing;
        }
        if !self.class_allows_share(id, g) {
            self.vms.get_mut(&id).expect("sharable").books.hot_skipped += 1;
            return Found::Nothing;
        }
        let h = (self.cfg.page_hash)(page);
        let zero = h == self.zero_hash && is_zero_page(page);
        match self.cfg.zero {
            ZeroPolicy::Keep if zero => {
                self.found_nothing(id, g);
                return Found::Nothing;
            }
            ZeroPolicy::Reclaim if zero => {
                let v = self.vms.get_mut(&id).expect("sharable");
                v.hints.age_reset(g);
                v.set(g, PageState::Reclaiming);
                v.queue.push(Command::Reclaim { gfn: g });
                self.scan.pass_requests += 1;
                return Found::Acted;
            }
            _ => {}
        }
        if self.never_share(id, g) {
            // Neither shared nor a hint another page could pair with (never_share.rs).
            self.found_nothing(id, g);
            return Found::Nothing;
        }
        let found = self.match_identical(id, g, page, h, zero, seen);
        match found {
            Found::Acted | Found::Deferred => {}
            Found::Hinted => self.found_nothing(id, g),
            Found::Nothing => {
                let gpn = crate::ids::Gpn(self.vms[&id].base.0 + g.0);
                let d = self.dom(id);
                // A quiet page is hinted in its hash interval's scans only (DE §4.3's
                // passes, `EngineConfig::share_passes`); a page new or changed lately,
                // or landed from disk, in every scan.
                let quiet = self.vms[&id].hints.scan_age(g.0) >= QUIET_AGE;
                let dom = self.domain_mut(d);
                if seen == Seen::Read || !quiet || dom.share.in_current_pass(h) {
                    dom.share.insert(h, ShareEntry::Hint(gpn));
                }
                if seen == Seen::Read {
                    self.keep_hint(d, h, gpn);
                }
                self.found_nothing(id, g);
            }
        }
        found
    }

    /// Looks private page `g` of guest `id` (holding `page`, hashing to `h`) up in its
    /// domain's share table and, on a frame or a hinted page whose bytes equal it, shares
    /// it (ESX §4.3): mapped, or without a mapping ([`Engine::identical_action`]; `seen`:
    /// who found the page).
    pub(crate) fn match_identical(
        &mut self,
        id: VmId,
        g: Gfn,
        page: &Page,
        h: u64,
        zero: bool,
        seen: Seen,
    ) -> Found {
        if self.never_share(id, g) {
            return Found::Nothing; // a page its guest marked never-share (never_share.rs)
        }
        let gpn = crate::ids::Gpn(self.vms[&id].base.0 + g.0);
        // Only the guest's own domain's share table: no share ever crosses domains.
        let d = self.dom(id);
        let mut other = [0u8; PAGE_SIZE];
        let candidates: Vec<ShareEntry> = self.domain(d).share.lookup(h).collect();
        for e in candidates {
            match e {
                ShareEntry::Shared(f) => {
                    // An unreadable pool (an adopted one is a peer's file) only means no
                    // share with this frame.
                    if let Err(e) = self.domain(d).pool.read(f.offset(), &mut other) {
                        if self.books.pool_error().is_some() {
                            tracing::warn!("pool of {d}: {e}; not shared");
                        }
                        continue;
                    }
                    // Read just now: not a frame to page out this round (kernel_swap.rs).
                    self.domain_mut(d).frames.touch(f);
                    if other == *page {
                        match self.identical_action(id, g, zero, seen) {
                            Identical::Defer => return Found::Deferred,
                            Identical::Unmapped if self.share_unmapped(id, g, f, page) => {
                                return Found::Acted
                            }
                            _ => {}
                        }
                        self.domain_mut(d).frames.add_pending(f);
                        self.enqueue_share(id, g, f);
                        return Found::Acted;
                    }
                }
                ShareEntry::Hint(hint) => {
                    if hint == gpn {
                        return Found::Hinted;
                    }
                    // A hint's guest may have left (and its gpn gone to another domain's
                    // guest): only a guest of this domain may pair with this page.
                    let Some((id2, g2)) = self.locate(hint).filter(|&(id2, g2)| {
                        self.dom(id2) == d
                            && self.sharable(id2, g2)
                            && !self.never_share(id2, g2)
                            && self.class_allows_share(id2, g2)
                    }) else {
                        self.domain_mut(d).share.remove(h, e);
                        continue;
                    };
                    if self.vms[&id2].ram.read(g2, &mut other).is_err() || other != *page {
                        self.domain_mut(d).share.remove(h, e); // the hinted page changed
                        continue;
                    }
                    // With a fresh class for this page (the clock's slice) or new data (a
                    // disk read), a hinted page cold by its last class is shared without a
                    // mapping too, judged as the clock would (its gates — the knob, zero
                    // pages, the re-store wait — still hold): deferred, it would be stored
                    // on its own (or keep a frame alone), and a frame held by one page
                    // saves nothing.
                    let as_clock = if seen == Seen::Scan {
                        seen
                    } else {
                        Seen::Clock
                    };
                    let partner = self.identical_action(id2, g2, zero, as_clock);
                    let pair = [
                        (id2, g2, partner),
                        (id, g, self.identical_action(id, g, zero, seen)),
                    ];
                    if pair.iter().all(|p| p.2 == Identical::Defer) {
                        // With partitioned hints, a pair left to the clock (not held
                        // back by VMA pressure, which the clock's slice does not lift)
                        // keeps its hint for the slice, scans later maybe
                        // (at_read::KEPT_HINTS).
                        if self.domain(d).share.passes() > 1
                            && !self.vma_pressure(id)
                            && !self.vma_pressure(id2)
                        {
                            self.keep_hint(d, h, hint);
                        }
                        return Found::Deferred;
                    }
                    // A pool that cannot take the frame (host out of memory) only means no
                    // share: the pages stay private and the hint stays.
                    let Some(f) = self.alloc_frame(d, page, h) else {
                        return Found::Deferred;
                    };
                    // (A zero page's frame is booked a zero frame by alloc_frame.)
                    self.domain_mut(d)
                        .share
                        .replace(h, e, ShareEntry::Shared(f));
                    // Each page mapped onto the new frame, shared without a mapping, or
                    // left for the clock; then the frame's first pending request (from
                    // its allocation) is given back.
                    for (id, g, a) in pair {
                        match a {
                            Identical::Defer => {}
                            Identical::Unmapped if self.share_unmapped(id, g, f, page) => {}
                            _ => {
                                self.domain_mut(d).frames.add_pending(f);
                                self.enqueue_share(id, g, f);
                            }
                        }
                    }
                    self.frame_answer(d, f, false);
                    return Found::Acted;
                }
            }
        }
        Found::Nothing
    }

    /// Page `g` of guest `id` was read in this scan and nothing was found for it.
    fn found_nothing(&mut self, id: VmId, g: Gfn) {
        if let Some(v) = self.vms.get_mut(&id) {
            v.hints.age_up(g.0);
        }
    }
}

#[cfg(test)]
mod tests;
