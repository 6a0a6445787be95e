//! The sharing scan (ESX §4.3): guest pages are read (holes skipped, so nothing is
//! faulted in), hashed and looked up in the share table; a match with a shared frame or
//! a hint is confirmed byte for byte, then the agent is asked to map the page onto the
//! frame. Scanning is rate-limited in pages/s; hints are dropped after each full scan,
//! and a quiet full scan doubles the time to the next one. Zero pages are reclaimed,
//! shared onto one zero frame, or kept, as the [`ZeroPolicy`] says.

use super::{Command, Engine, EngineError, ZeroPolicy};
use crate::ids::{Gfn, VmId};
use crate::p2m::PageState;
use crate::share::ShareEntry;
use crate::{is_zero_page, Page, PAGE_SIZE};

/// Pages read at a time.
pub(crate) const READ_PAGES: usize = 64;

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
    /// Rate limiter: pages that may be read, and when it was last filled.
    tokens: f64,
    last_us: u64,
}

impl ScanState {
    pub(crate) fn new(now_us: u64) -> Self {
        ScanState {
            full_scans: 0,
            pass_started_us: now_us,
            interval_us: 0,
            pass_read: 0,
            pass_requests: 0,
            tokens: 0.0,
            last_us: now_us,
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
        // Start the next full scan: hints from the last one are stale (ESX §4.3).
        for dom in self.domains.values_mut() {
            dom.share.end_pass();
        }
        let s = &mut self.scan;
        s.full_scans += 1;
        s.pass_started_us = now;
        for v in self.vms.values_mut() {
            v.scanned_this_pass = false;
        }
        false
    }

    /// Scans up to `budget` pages, round-robin over guests not yet scanned in this pass.
    fn scan(&mut self, mut budget: u32) -> Result<(), EngineError> {
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
        let mut buf = vec![0u8; READ_PAGES * PAGE_SIZE];
        for id in ids {
            let mut mine = share.min(budget);
            while mine > 0 {
                let Some((first, n)) = self.next_chunk(id, mine as usize, &mut buf) else {
                    break;
                };
                mine = mine.saturating_sub(n as u32);
                budget = budget.saturating_sub(n as u32);
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

    /// Reads the next run of resident pages of guest `id` from its cursor; `None` at the
    /// end of its RAM (its part of the full scan is then done).
    fn next_chunk(&mut self, id: VmId, max: usize, buf: &mut [u8]) -> Option<(Gfn, usize)> {
        let v = self.vms.get_mut(&id)?;
        let end = Gfn(v.pages());
        let Some((first, run_end)) = v.ram.next_data_run(Gfn(v.cursor), end) else {
            v.cursor = 0;
            v.scanned_this_pass = true;
            return None;
        };
        let n = ((run_end.0 - first.0) as usize)
            .min(max)
            .clamp(1, READ_PAGES);
        if v.ram.read(first, &mut buf[..n * PAGE_SIZE]).is_err() {
            v.cursor = 0;
            v.scanned_this_pass = true;
            return None;
        }
        v.cursor = first.0 + n as u32;
        v.books.scanned_pages += n as u64;
        self.scan.pass_read += n as u64;
        if v.cursor >= v.pages() {
            v.cursor = 0;
            v.scanned_this_pass = true;
        }
        Some((first, n))
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
        if !self.sharable(id, g) {
            return Ok(());
        }
        if !self.class_allows_share(id, g) {
            self.vms.get_mut(&id).expect("sharable").books.hot_skipped += 1;
            return Ok(());
        }
        let h = (self.cfg.page_hash)(page);
        let zero = h == self.zero_hash && is_zero_page(page);
        match self.cfg.zero {
            ZeroPolicy::Keep if zero => return Ok(()),
            ZeroPolicy::Reclaim if zero => {
                let v = self.vms.get_mut(&id).expect("sharable");
                v.set(g, PageState::Reclaiming);
                v.queue.push(Command::Reclaim { gfn: g });
                self.scan.pass_requests += 1;
                return Ok(());
            }
            _ => {}
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
                        self.books.pool_errors += 1;
                        if self.books.pool_errors.is_power_of_two() {
                            tracing::warn!("pool of {d}: {e}; not shared");
                        }
                        continue;
                    }
                    if other == *page {
                        self.domain_mut(d).frames.add_pending(f);
                        self.enqueue_share(id, g, f);
                        return Ok(());
                    }
                }
                ShareEntry::Hint(hint) => {
                    if hint == gpn {
                        return Ok(());
                    }
                    // A hint's guest may have left (and its gpn gone to another domain's
                    // guest): only a guest of this domain may pair with this page.
                    let Some((id2, g2)) = self.locate(hint).filter(|&(id2, g2)| {
                        self.dom(id2) == d
                            && self.sharable(id2, g2)
                            && self.class_allows_share(id2, g2)
                    }) else {
                        self.domain_mut(d).share.remove(h, e);
                        continue;
                    };
                    if self.vms[&id2].ram.read(g2, &mut other).is_err() || other != *page {
                        self.domain_mut(d).share.remove(h, e); // the hinted page changed
                        continue;
                    }
                    // A pool that cannot take the frame (host out of memory) only means no
                    // share: the pages stay private and the hint stays.
                    let Some(f) = self.alloc_frame(d, page, h) else {
                        return Ok(());
                    };
                    let dom = self.domain_mut(d);
                    dom.frames.add_pending(f);
                    dom.share.replace(h, e, ShareEntry::Shared(f));
                    if zero {
                        dom.zero_frame = Some(f);
                    }
                    self.enqueue_share(id2, g2, f);
                    self.enqueue_share(id, g, f);
                    return Ok(());
                }
            }
        }
        self.domain_mut(d).share.insert(h, ShareEntry::Hint(gpn));
        Ok(())
    }
}
