//! The VMA budget of shares, kept for the whole process: how many mappings QEMU has, and
//! how many guest pages of all its regions are mapped onto pool frames.
//!
//! **Invariant (process-wide).** With `M` the mappings (VMAs) of this process, `F` the
//! pages of *every* guest RAM region of this process mapped onto pool frames, and `R`
//! the room reserved by shares in progress (3 per page), the agents keep
//! `M + F + R ≤ budget` (`MEMFOLD_VMA_BUDGET`, default `vm.max_map_count − 4096`):
//! a share is admitted only for as many pages as keep it ([`Vmas::admit`]). Why `F`:
//! a CoW break cannot be refused, and no sequence of CoW breaks, discards or take-backs
//! adds more mappings than there are pages on frames (`requests.rs`, `share`) — so
//! however the guest writes, `M` stays within the budget and no break fails on
//! `vm.max_map_count`.
//!
//! Why for the whole process: `vm.max_map_count` bounds a process, and `M`
//! (`/proc/self/maps`) counts the whole process, while a QEMU with several RAM regions
//! runs one agent per region (`regions.rs`). Were `F` one region's pages only, each agent
//! would reserve break headroom for its own pages, and breaks in the other regions
//! (whose headroom nobody reserved) could take QEMU past the limit. So `F` is one counter
//! for the process ([`PROCESS`]), updated by every region's page table on every change
//! of a page's home (`state::Pages::set`, and when a detached region's table is
//! dropped); the count of mappings and the agents' changes since it was read are one
//! for the process too; and admitting a share (checking and reserving) is done under one
//! lock, so two regions' shares never both take the same room.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The process's one [`Vmas`]: every agent (every region) of this process counts here.
pub(crate) static PROCESS: Vmas = Vmas::new(EXACT_EVERY);

/// Longest time a share request relies on the count of mappings last read (plus the
/// agents' own changes since) before reading `/proc/self/maps` again. Re-read every second
/// it was still a third of the agents' CPU in a sharing run (perf); QEMU's own mappings
/// hardly change once it runs, and the 4096 held back from the budget are their room.
const MAPS_STALE: Duration = Duration::from_secs(10);

/// Shortest time between two reads of `/proc/self/maps` made to refuse a share on an
/// exact count. At the budget every share request would be refused, and re-reading a
/// QEMU's 8 000 mappings for each one took a core (perf of a 2 GiB guest at its budget:
/// 87 of 150 s of agent CPU, most in `mangle_path` and `show_map_vma`). A count up to 1 s
/// old plus the agents' changes since is still an upper bound: it can only refuse more.
const EXACT_EVERY: Duration = Duration::from_secs(1);

/// The process's mappings and pages on frames, for the VMA budget of shares.
pub(crate) struct Vmas {
    /// Pages of every region of this process mapped onto pool frames (`F`).
    on_frames: AtomicUsize,
    /// Most mappings the agents' own changes added since the last read (2 a change).
    /// Outside the lock: a CoW break never waits for a share's admission.
    added: AtomicUsize,
    /// The last count read, and the room reserved.
    count: Mutex<Count>,
    /// Shortest time between two reads made to refuse on an exact count.
    exact_every: Duration,
}

/// What [`Vmas::admit`] keeps under its lock.
struct Count {
    /// Mappings `/proc/self/maps` listed at the last read.
    seen: usize,
    /// When it was read; `None`: never.
    read_at: Option<Instant>,
    /// Room reserved by shares in progress (`R`: 3 a page).
    reserved: usize,
}

impl Vmas {
    /// No mappings counted, no page on a frame; a refusal reads the mappings again if
    /// the last read is older than `exact_every`.
    pub(crate) const fn new(exact_every: Duration) -> Vmas {
        Vmas {
            exact_every,
            on_frames: AtomicUsize::new(0),
            added: AtomicUsize::new(0),
            count: Mutex::new(Count {
                seen: 0,
                read_at: None,
                reserved: 0,
            }),
        }
    }

    /// `more` pages (of any region) went onto pool frames and `fewer` left them.
    pub(crate) fn frames_changed(&self, more: usize, fewer: usize) {
        if more > 0 {
            self.on_frames.fetch_add(more, Ordering::SeqCst);
        }
        if fewer > 0 {
            self.on_frames.fetch_sub(fewer, Ordering::SeqCst);
        }
    }

    /// Pages of every region of this process on pool frames now.
    pub(crate) fn on_frames(&self) -> usize {
        self.on_frames.load(Ordering::SeqCst)
    }

    /// The process's mappings as counted: the last read of `/proc/self/maps` plus the
    /// agents' changes since (2 a change: an upper bound); 0 before the first read.
    pub(crate) fn mappings(&self) -> usize {
        let seen = self.count.lock().unwrap_or_else(|e| e.into_inner()).seen;
        seen + self.added.load(Ordering::SeqCst)
    }

    /// An agent changed one mapping: a move of pool frames over guest pages or guest RAM
    /// mapped back over a page, each splitting a mapping in at most 3.
    pub(crate) fn changed(&self) {
        self.added.fetch_add(2, Ordering::SeqCst);
    }

    /// Admits a share of up to `want` pages within `budget` (the invariant in the module
    /// docs): returns how many of the first pages may be shared, with their room reserved
    /// until the returned [`Admission`] is dropped (when the share is done, its pages
    /// then counted in `on_frames` and its mappings in the count).
    ///
    /// The count of mappings is the one last read plus the agents' changes since; it is
    /// read again (`read_maps`, `/proc/self/maps` in the agent) when over
    /// [`MAPS_STALE`] old, or before refusing any page.
    pub(crate) fn admit(
        &self,
        budget: usize,
        want: usize,
        read_maps: impl Fn() -> usize,
    ) -> Admission<'_> {
        let mut c = self.count.lock().unwrap_or_else(|e| e.into_inner());
        let mut room = self.room(&mut c, budget, false, &read_maps);
        if want > room {
            // Refused only on an exact count.
            room = self.room(&mut c, budget, true, &read_maps);
        }
        let pages = want.min(room);
        c.reserved += 3 * pages;
        Admission {
            vmas: self,
            pages,
            reserved: 3 * pages,
        }
    }

    /// Pages a share may still map: `(budget − M − F − R) / 3`, `M` read again when
    /// stale, or when `exact` and older than `exact_every`.
    fn room(
        &self,
        c: &mut Count,
        budget: usize,
        exact: bool,
        read_maps: &impl Fn() -> usize,
    ) -> usize {
        let older = |d: Duration| c.read_at.is_none_or(|t| t.elapsed() > d);
        if older(MAPS_STALE) || (exact && older(self.exact_every)) {
            // Changes made while reading stay counted (twice if the read saw them: more,
            // never fewer).
            let before = self.added.load(Ordering::SeqCst);
            c.seen = read_maps();
            self.added.fetch_sub(before, Ordering::SeqCst);
            c.read_at = Some(Instant::now());
        }
        let used = c.seen + self.added.load(Ordering::SeqCst) + self.on_frames() + c.reserved;
        budget.saturating_sub(used) / 3
    }
}

/// Room reserved for one share ([`Vmas::admit`]); released when dropped.
pub(crate) struct Admission<'a> {
    vmas: &'a Vmas,
    /// Pages admitted.
    pub(crate) pages: usize,
    /// Room held (3 a page).
    reserved: usize,
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        let mut c = self.vmas.count.lock().unwrap_or_else(|e| e.into_inner());
        c.reserved -= self.reserved;
    }
}

/// This process's mappings now: the lines of `/proc/self/maps` (0 if it cannot be read).
/// Costs milliseconds for a QEMU with thousands of shared runs (docs/peer.md, "CPU of
/// sharing alone"), hence [`MAPS_STALE`].
pub(crate) fn read_self_maps() -> usize {
    std::fs::read("/proc/self/maps")
        .map(|m| m.iter().filter(|&&b| b == b'\n').count())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{PageHome, Pages};
    use memfold_ids::{FrameId, Gfn};

    /// Two regions' page tables on one process count: pages on frames in one region leave
    /// less room for shares in the other. Per-region accounting (each region's own pages
    /// on frames) would admit region B's whole request here, and CoW breaks in both
    /// regions could then add 60 + 60 mappings to the 10 of a budget of 100.
    #[test]
    fn pages_on_frames_in_one_region_leave_less_room_in_another() {
        let vmas: &'static Vmas = Box::leak(Box::new(Vmas::new(Duration::ZERO)));
        let budget = 100;
        let maps = || 10;
        let mut a = Pages::new(64, vmas);
        let mut b = Pages::new(64, vmas);
        // Region A shares what it may: (100 − 10) / 3 = 30 at once.
        let first = vmas.admit(budget, 64, maps);
        assert_eq!(first.pages, 30);
        for g in 0..first.pages {
            a.set(Gfn(g as u32), PageHome::Frame(FrameId(g as u32)));
        }
        drop(first);
        assert_eq!(vmas.on_frames(), 30);
        // Region B: 100 − 10 − 30 left, a third of it.
        let second = vmas.admit(budget, 60, maps);
        assert_eq!(
            second.pages, 20,
            "region A's pages on frames count for B too"
        );
        // And while B's share is in progress, its room is held from A.
        assert_eq!(vmas.admit(budget, 60, maps).pages, 0);
        for g in 0..second.pages {
            b.set(Gfn(g as u32), PageHome::Frame(FrameId(g as u32)));
        }
        drop(second);
        assert_eq!(vmas.on_frames(), 50);
        // M + F within the budget, whatever breaks come.
        assert!(maps() + vmas.on_frames() <= budget);
        // Pages leaving frames (a CoW break, a discard) and a region dropped (hot-unplug)
        // give the room back.
        b.set(Gfn(0), PageHome::Private);
        assert_eq!(vmas.on_frames(), 49);
        drop(b);
        assert_eq!(vmas.on_frames(), 30);
        drop(a);
        assert_eq!(vmas.on_frames(), 0);
    }

    /// The agents' changes since the last read count until the next read, which replaces
    /// them; a stale count is read again only before refusing.
    #[test]
    fn changes_count_until_the_next_read() {
        let vmas = Vmas::new(Duration::ZERO);
        let reads = std::cell::Cell::new(0);
        let maps = || {
            reads.set(reads.get() + 1);
            10
        };
        assert_eq!(vmas.admit(100, 1, maps).pages, 1);
        assert_eq!(reads.get(), 1);
        for _ in 0..15 {
            vmas.changed();
        }
        // 10 + 30 used: 20 pages of room without reading; 30 asked for: read again.
        assert_eq!(vmas.admit(100, 20, maps).pages, 20);
        assert_eq!(reads.get(), 1);
        assert_eq!(vmas.admit(100, 30, maps).pages, 30);
        assert_eq!(reads.get(), 2);
    }

    /// At the budget, refusals read the mappings at most once per `exact_every`, each
    /// refusal still on a count that is an upper bound.
    #[test]
    fn refusals_at_the_budget_read_the_mappings_once_a_second_not_each_time() {
        let vmas = Vmas::new(Duration::from_secs(3600));
        let reads = std::cell::Cell::new(0);
        let maps = || {
            reads.set(reads.get() + 1);
            97
        };
        // (100 − 97) / 3 = 1 page of room: a share of 2 reads once (its count is fresh
        // for the exact check too) and gets 1.
        let first = vmas.admit(100, 2, maps);
        assert_eq!((first.pages, reads.get()), (1, 1));
        // Held: nothing left, and a thousand refusals read nothing more.
        for _ in 0..1000 {
            assert_eq!(vmas.admit(100, 1, maps).pages, 0);
        }
        assert_eq!(reads.get(), 1);
        drop(first);
        assert_eq!(vmas.admit(100, 1, maps).pages, 1, "its room given back");
        // With exact_every 0, each refusal reads again (the old behaviour).
        let eager = Vmas::new(Duration::ZERO);
        let full = || {
            reads.set(reads.get() + 1);
            100
        };
        reads.set(0);
        for _ in 0..5 {
            assert_eq!(eager.admit(100, 1, full).pages, 0);
        }
        assert_eq!(reads.get(), 6, "the first read and one per refusal");
    }
}
