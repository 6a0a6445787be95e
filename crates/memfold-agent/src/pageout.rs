//! Pages sent to the kernel's swap (issue 15's zswap backing; docs/peer.md, "A zswap
//! backing"): memfoldd picks cold private pages that compress, the agent pages them out
//! through a read-only window of its own onto guest RAM's memfd
//! ([`memfold_sys::pageout`]), and the kernel keeps them in zswap. A page's bytes never
//! leave guest RAM's memfd (the page cache names the swap entry), so nothing is checked
//! or decoded here: under the `pagemap` clock's registration (`MISSING | WP`) the guest's
//! next access is the kernel's own swap-in, with no userfault; a write to a page the clock
//! write-protected still faults to the agent (M stays exact; the uffd-wp marker survives
//! the page-out). Under the `userfault` clock (`MINOR` registered) the swap-in comes as a
//! minor fault the agent answers with `UFFDIO_CONTINUE`: correct, but a round trip.
//!
//! The agent keeps a bit per page it paged out ([`crate::state::Pages`]) and, at each
//! clock scan of the page's slice, reports those found in RAM again
//! (`ToDaemon::PagedIn`), so memfoldd's books know what zswap holds.
//!
//! Pool frames go to the kernel's swap too, once no process maps them: the clock scan
//! drops guest pages' mappings of frames ([`Agent::zap_shared`]) so that frames no guest
//! reads can be paged out of the pool.

use std::io;
use std::os::fd::AsFd;

use memfold_ids::Gfn;
use memfold_sys::pageout::PageOutWindow;

use crate::install::Job;
use crate::requests::Outcome;
use crate::state::{plus, PageHome};
use crate::{Agent, PAGE};

impl Agent {
    /// The window onto guest RAM's memfd, made at the first page-out (a mapping, but no
    /// memory: a guest never paged out costs QEMU no VMA).
    ///
    /// Errors: the mapping failed.
    fn window(&mut self) -> io::Result<&PageOutWindow> {
        if self.window.is_none() {
            self.window = Some(PageOutWindow::new(self.memfd.as_fd(), self.ram_bytes)?);
        }
        Ok(self.window.as_ref().expect("made above"))
    }

    /// Carries out a page-out request: each private page that nothing else maps leaves
    /// RAM for the kernel's swap. Pages not private (shared, stashed, reclaimed: memfold
    /// holds them already), past guest RAM or paged out already are refused. In the
    /// outcome, `done` left RAM and `changed` stayed (in use, mapped elsewhere, a hole,
    /// no swap).
    ///
    /// A failure is answered, not raised (paging out is an offer, never owed): if the
    /// window cannot be made every page asked is refused; if `madvise` failed for a span,
    /// the pages not seen leaving RAM are answered as still in it. No page's bytes change
    /// either way, pages marked so far stay marked, and the connection stays (before, a
    /// failure dropped it and cost a re-attach that lists every page;
    /// tests/page_out_fault.rs).
    pub(crate) fn page_out(&mut self, gfns: Vec<Gfn>) -> Outcome {
        let mut out = Outcome::default();
        let mut gfns = self.private_only(gfns, &mut out);
        gfns.retain(|&g| {
            let ok = !self.pages.is_paged_out(g);
            if !ok {
                out.refused.push(g);
            }
            ok
        });
        out.refused.sort_unstable();
        if gfns.is_empty() {
            return out;
        }
        let pages: Vec<u64> = gfns.iter().map(|g| g.0 as u64).collect();
        let window = match self.window() {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!("{} pages not paged out: no window: {e}", gfns.len());
                out.refused.extend(gfns);
                out.refused.sort_unstable();
                return out;
            }
        };
        let (left, result) = window.page_out_list(&pages);
        // Pages that left are marked even if a later span failed.
        for (g, left) in gfns.into_iter().zip(left) {
            if left {
                self.pages.paged_out(g);
                out.done.push(g);
            } else {
                out.changed.push(g);
            }
        }
        if let Err(e) = result {
            tracing::warn!("paging out: {e}; pages not seen leaving RAM answered as in it");
        }
        out
    }

    /// Before a clock scan of `[first, first+n)`: the pages paged out there that are in
    /// RAM again lose their bits and are reported to memfoldd with the next events
    /// (`ToDaemon::PagedIn`). Should reading residency fail (it worked when the window
    /// was made), the pages stay marked and are asked about at the next scan.
    ///
    /// Residency is read only over the spans holding paged-out pages
    /// ([`MINCORE_GAP`]), not the whole slice: `mincore` looks each page up in the
    /// page cache (and a swapped one in the swap cache), and most of a slice is not
    /// paged out.
    pub(crate) fn paged_in(&mut self, first: Gfn, n: u32) {
        let spans = self.pages.paged_out_spans(first, n, MINCORE_GAP);
        if spans.is_empty() {
            return;
        }
        let Some(w) = self.window.as_ref() else {
            return;
        };
        for (s, len) in spans {
            let resident = match w.resident(s.0 as u64, len as u64) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("reading which paged-out pages are back: mincore: {e}");
                    return;
                }
            };
            for (k, back) in resident.into_iter().enumerate() {
                let g = Gfn(s.0 + k as u32);
                if back && self.pages.is_paged_out(g) {
                    self.pages.paged_in(g);
                    self.pending.paged_in.push(g);
                }
            }
        }
    }
}

impl Agent {
    /// Drops the PTEs of the pages of `[first, first + n)` mapped onto pool frames (issue
    /// 15): a frame that no guest reads until memfoldd's next round of frame page-outs
    /// is then mapped by no process, and the kernel, which pages out only what nothing
    /// maps, can take it from the pool; a page read meanwhile is mapped back by the
    /// kernel's own minor fault (the pool mapping is registered for write-protect faults
    /// only), a swapped-out frame swapped in by it.
    ///
    /// Invariant: a pool frame is never writable through a guest's mapping. Each run is
    /// write-protected again just before its zap, so that every PTE the zap drops leaves
    /// a uffd-wp marker: the kernel maps the frame back write-protected, and a write is a
    /// write-protect fault, the CoW break, as before (tests/shared_zap.rs writes a zapped
    /// shared page and checks that the frame kept its bytes; seen failing, the write in
    /// the frame, with the runs unprotected before their zap). The kernel's remove events
    /// for these ranges are dropped as the agent's own (`Job::ZapFrames`), not taken for
    /// QEMU discarding the pages.
    ///
    /// In the clock's `pagemap` mode a run none of whose pages had a PTE when the scan
    /// read its R bits ([`crate::rbits::Mapped`]) is write-protected but not zapped: no
    /// PTE to drop, and most runs of a pass are on frames no guest read since the last
    /// (each zap is a `MADV_DONTNEED` and a remove event read back, for nothing).
    ///
    /// Errors: the zap failed (the pages stay on their frames, mapped or not, protected
    /// either way); a run whose write-protection fails is left as it is, logged.
    pub(crate) fn zap_shared(&mut self, first: Gfn, n: u32) -> io::Result<()> {
        let frame = |agent: &Agent, k: u32| match agent.pages.home(plus(first, k as usize)) {
            PageHome::Frame(f) => Some(f.0),
            _ => None,
        };
        // The scan's own reading of the page tables, if it made one of this slice.
        let mapped = self.mapped_at_scan.take().filter(|m| m.covers(first, n));
        let mut k = 0;
        while k < n {
            // A chunk of runs at a time, then the faults read meanwhile: the kernel
            // reports each VMA's zap and waits for the report to be read, and a pass can
            // cross thousands of pool mappings, so faults are not left waiting for all
            // of them. The next chunk's runs are found after those faults are served.
            let mut runs = Vec::new();
            while k < n && runs.len() < ZAP_CHUNK_RUNS {
                let Some(f0) = frame(self, k) else {
                    k += 1;
                    continue;
                };
                // One run per pool mapping (consecutive frames, as a share maps them):
                // kernels before 6.4 refuse a write-protection across mappings.
                let mut e = k + 1;
                while e < n && frame(self, e) == Some(f0 + (e - k)) {
                    e += 1;
                }
                let (addr, len) = (
                    self.page_addr(plus(first, k as usize)),
                    (e - k) as u64 * PAGE,
                );
                // Only a run just protected is zapped, so that its dropped PTEs leave
                // markers; one the kernel refuses to protect keeps its PTEs. A run with
                // no PTE is protected all the same (a marker on every page of it).
                match self.uffd.write_protect(addr, len, true) {
                    Ok(()) if mapped.as_ref().is_some_and(|m| m.span(k, e).is_none()) => {
                        self.counters.clock_zaps_skipped += 1;
                    }
                    Ok(()) => runs.push((addr, len)),
                    Err(e) => tracing::warn!("{len} bytes at {addr:#x} on frames: {e}"),
                }
                k = e;
            }
            // Empty only at the slice's end (runs left alone do not fill a chunk).
            if runs.is_empty() {
                break;
            }
            self.counters.clock_zaps += runs.len() as u64;
            let errno = self.helper(Job::ZapFrames(runs));
            for ev in std::mem::take(&mut self.deferred) {
                self.handle_or_retry(ev);
            }
            if errno != 0 {
                return Err(io::Error::other(format!(
                    "dropping the PTEs of shared pages: madvise: {}",
                    io::Error::from_raw_os_error(errno)
                )));
            }
        }
        Ok(())
    }
}

/// Pages not paged out that [`Agent::paged_in`] reads residency across rather than make
/// another `mincore` call: a call costs about what looking up this many pages does.
const MINCORE_GAP: u32 = 16;

/// Most runs of shared pages zapped in one job of [`Agent::zap_shared`] before the faults
/// read meanwhile are served.
const ZAP_CHUNK_RUNS: usize = 32;
