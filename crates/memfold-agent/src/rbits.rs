//! The NRU clock's R bits (DE §4.2), taken one of two ways ([`ClockRBits`]): by minor
//! userfaults the agent answers, or, in the `pagemap` mode, from the page tables — guest
//! RAM registered without `MINOR`, so an armed page's first access is the kernel's own
//! minor fault, read back at the slice's next scan as "the PTE the clock zapped is present
//! again" (`PAGEMAP_SCAN`, [`memfold_sys::pagemap`]). M comes from write-protect faults
//! either way (the zap keeps the uffd-wp markers).

use memfold_ids::Gfn;
use memfold_sys::pagemap::{Pagemap, PAGE_IS_PRESENT};
use memfold_sys::uffd;

use crate::{Agent, ClockRBits, PAGE, PAGEMAP_CLOCK_LOG};

/// Guest RAM (and pages given back to it) is registered for all three fault kinds when
/// the clock takes R from minor userfaults ([`ClockRBits::Userfault`]).
const RAM_MODE: u64 = uffd::MODE_MISSING | uffd::MODE_WP | uffd::MODE_MINOR;
/// ... and for missing and write-protect faults only when it reads R back from the page
/// tables ([`ClockRBits::Pagemap`]): an armed page's first access is then the kernel's.
const RAM_MODE_PAGEMAP: u64 = uffd::MODE_MISSING | uffd::MODE_WP;

/// The clock's R-bit reader for `rbits`, or `None` (minor userfaults): `pagemap` needs
/// `PAGEMAP_SCAN` to work on this region (Linux 6.7+); without it the agent says so and
/// falls back to `userfault`, which every kernel with userfaultfd minor faults has.
pub(crate) fn reader(rbits: ClockRBits, base: u64, name: &str) -> Option<Pagemap> {
    if rbits != ClockRBits::Pagemap {
        return None;
    }
    let probe = Pagemap::open().and_then(|mut pm| {
        pm.scan(base, PAGE, PAGE_IS_PRESENT, 0)?;
        Ok(pm)
    });
    match probe {
        Ok(pm) => {
            tracing::info!("{name}: {PAGEMAP_CLOCK_LOG} (PAGEMAP_SCAN)");
            Some(pm)
        }
        Err(e) => {
            tracing::warn!(
                "{name}: MEMFOLD_CLOCK_RBITS=pagemap, but PAGEMAP_SCAN fails here ({e}): \
                 taking R bits from minor userfaults instead"
            );
            None
        }
    }
}

/// How guest RAM is registered with the page tables' `reader` or without one: every
/// range of guest RAM (re)registered uses the same mode, so its VMAs stay mergeable.
pub(crate) fn ram_mode(reader: Option<&Pagemap>) -> u64 {
    if reader.is_some() {
        RAM_MODE_PAGEMAP
    } else {
        RAM_MODE
    }
}

impl Agent {
    /// How this agent registers guest RAM ([`ram_mode`]).
    pub(crate) fn ram_mode(&self) -> u64 {
        ram_mode(self.rbits.as_ref())
    }

    /// In the `pagemap` mode, before the clock scan of `[first, first+n)` takes its bits:
    /// sets R for each page zapped at its last arming whose PTE is back (an in-kernel
    /// minor fault mapped it), and counts it as a minor fault (the kernel's; not timed: no
    /// guest waited on the agent). An access between this read and the scan's zap is lost
    /// if the zap re-arms the page (its PTE dropped again): a heuristic's miss, which the
    /// userfault mode does not have. Nothing in the userfault mode.
    ///
    /// What it reads is also kept for the scan's zap of pages on frames
    /// ([`Agent::mapped_at_scan`]): which of the slice's pages have a PTE now.
    pub(crate) fn read_rbits(&mut self, first: Gfn, n: u32) {
        self.mapped_at_scan = None;
        let start = self.page_addr(first);
        let Some(pm) = self.rbits.as_mut() else {
            return;
        };
        let (base, pages, minor) = (self.base, &mut self.pages, &mut self.counters.minor_faults);
        let mut mapped = Mapped::none(first, n);
        let read = pm.scan_regions(start, n as u64 * PAGE, PAGE_IS_PRESENT, 0, |region| {
            for a in (region.start..region.end).step_by(PAGE as usize) {
                let g = Gfn(((a - base) / PAGE) as u32);
                mapped.set(g);
                if pages.present(g) {
                    *minor += 1;
                }
            }
        });
        match read {
            Ok(_) => self.mapped_at_scan = Some(mapped),
            Err(e) => {
                // It worked at the probe; should it fail now, the slice's armed pages
                // are taken as used (none thought idle for want of a reading) and the
                // scan goes on: R is a heuristic, and the connection is no reason to
                // drop. No reading is kept: the scan's zaps then zap every run.
                tracing::warn!(
                    "reading R bits: PAGEMAP_SCAN: {e}; the slice's armed pages count as used"
                );
                self.pages.all_zapped_referenced(first, n as u64);
            }
        }
    }
}

/// Which pages of a clock slice had a PTE when the scan read its R bits (`PAGEMAP_SCAN`,
/// `PAGE_IS_PRESENT`), a bit a page.
///
/// Kept for the scan's zap of pages on pool frames (`Agent::zap_shared`): a run of which
/// no page was mapped has no PTE to drop, and zapping it would cost a `MADV_DONTNEED`
/// and a remove event for nothing. A page mapped after the read (the guest read it
/// meanwhile) is only kept mapped until the next scan: its frame stays in RAM a pass
/// longer, no byte depends on it (the run is write-protected all the same).
pub(crate) struct Mapped {
    /// The slice's first page.
    first: Gfn,
    /// Pages in the slice.
    n: u32,
    /// Bit k of word k / 64: page `first + k` was mapped.
    bits: Vec<u64>,
}

impl Mapped {
    /// A slice of `n` pages from `first`, none mapped yet.
    pub(crate) fn none(first: Gfn, n: u32) -> Mapped {
        Mapped {
            first,
            n,
            bits: vec![0; (n as usize).div_ceil(64)],
        }
    }

    /// Page `g` is mapped (ignored outside the slice).
    pub(crate) fn set(&mut self, g: Gfn) {
        if let Some(k) = g.0.checked_sub(self.first.0).filter(|&k| k < self.n) {
            self.bits[k as usize / 64] |= 1 << (k % 64);
        }
    }

    /// Whether this reading covers pages `[first, first + n)` of a scan.
    pub(crate) fn covers(&self, first: Gfn, n: u32) -> bool {
        self.first == first && n <= self.n
    }

    /// The pages of `[first + from, first + to)` (slice offsets) from the first mapped
    /// to the last mapped, as slice offsets `[lo, hi)`; `None` if none was mapped.
    pub(crate) fn span(&self, from: u32, to: u32) -> Option<(u32, u32)> {
        let is = |k: &u32| self.bits[*k as usize / 64] >> (k % 64) & 1 == 1;
        let to = to.min(self.n);
        let lo = (from..to).find(is)?;
        let hi = (lo..to).rev().find(is)?;
        Some((lo, hi + 1))
    }
}
