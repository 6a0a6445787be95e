//! The VMA budget of shares, kept for the whole process: how many mappings QEMU has, and
//! how many guest pages of all its regions are mapped onto pool frames.
//!
//! **Invariant (process-wide).** With `M` the mappings (VMAs) of this process and `R`
//! the room reserved by shares in progress (3 per page), the agents keep
//! `M + R ≤ budget − budget / 8` for shares (`budget`: `MEMFOLD_VMA_BUDGET`, default
//! `vm.max_map_count − 4096`, followed as it changes: [`Budget`]): a share is admitted only for as many pages as keep it
//! ([`Vmas::admit`]). A CoW break cannot be refused, and one that maps guest RAM back over
//! one page of a run of shared pages splits the run's mapping in three (+2). So a break
//! maps one page back only while `M + R + 2 ≤ budget` ([`Vmas::break_fits`]); past that
//! it breaks the whole run of pages on consecutive frames around the page
//! (`fault.rs`, `cow_break_run`): guest RAM mapped back over whole pool mappings adds
//! none. However the guest writes, `M` stays within the budget (but for the two
//! mappings a run at a region's edge may add, which the 4096 held back cover) and no
//! break fails on `vm.max_map_count`.
//!
//! Why not charge each page on a frame (`M + F + R ≤ budget`, `F` the pages on frames,
//! as before issue 19): shared pages come in long runs, a few per mapping, and charging
//! each stopped a 2–4 GiB guest's sharing at ~57 000 pages while its QEMU had 8 000
//! mappings (docs/scale.md). The price of not charging them is paid only at the budget:
//! a break there un-shares its whole run.
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
pub(crate) static PROCESS: Vmas = Vmas::new(EXACT_EVERY, REPORT_STALE);

/// Longest time a share request relies on the count of mappings last read (plus the
/// agents' own changes since) before reading `/proc/self/maps` again. Re-read every second
/// it was still a third of the agents' CPU in a sharing run (perf); QEMU's own mappings
/// hardly change once it runs, and the 4096 held back from the budget are their room.
pub(crate) const MAPS_STALE: Duration = Duration::from_secs(10);

/// Shortest time between two reads of `/proc/self/maps` made to refuse a share on an
/// exact count. At the budget every share request would be refused, and re-reading a
/// QEMU's 8 000 mappings for each one took a core (perf of a 2 GiB guest at its budget:
/// 87 of 150 s of agent CPU, most in `mangle_path` and `show_map_vma`). A count up to 1 s
/// old plus the agents' changes since is still an upper bound: it can only refuse more.
const EXACT_EVERY: Duration = Duration::from_secs(1);

/// Oldest read of `/proc/self/maps` the agent's report of its mappings relies on
/// ([`Vmas::mappings_read`]) once the agents' changes since the read could put its count
/// over [`REPORT_SLACK`] above the true one; with fewer changes, a read up to
/// [`MAPS_STALE`] old (the hot-plug watch's, every [`crate::regions::WATCH_BACKSTOP`]
/// at least).
pub(crate) const REPORT_STALE: Duration = Duration::from_secs(3);

/// Most mappings the reported count may run over the true one (the agents' changes since
/// the last read, 2 each, the worst case) before the report reads again at
/// [`REPORT_STALE`]: 256 of a budget of ~61 000 (`vm.max_map_count` 65 530 less 4 096) is
/// well inside the margin of memfoldd's VMA warning (7/8 of the budget).
pub(crate) const REPORT_SLACK: usize = 256;
const _: () = assert!(
    crate::regions::WATCH_BACKSTOP.as_millis() + crate::regions::WATCH_PERIOD.as_millis()
        <= MAPS_STALE.as_millis()
);

/// The process's mappings and pages on frames, for the VMA budget of shares.
pub(crate) struct Vmas {
    /// Most mappings the agents' own changes added since the last read (2 a change).
    /// Outside the lock: a CoW break never waits for a share's admission.
    added: AtomicUsize,
    /// The last count read, and the room reserved.
    count: Mutex<Count>,
    /// Shortest time between two reads made to refuse on an exact count.
    exact_every: Duration,
    /// Oldest read the report takes past [`REPORT_SLACK`] ([`REPORT_STALE`]).
    report_stale: Duration,
}

/// What [`Vmas::admit`] keeps under its lock.
struct Count {
    /// Mappings `/proc/self/maps` listed at the last read.
    seen: usize,
    /// When it was read; `None`: never.
    read_at: Option<Instant>,
    /// Room reserved by shares in progress (`R`: 3 a page).
    reserved: usize,
    /// Reads taken so far: [`Vmas::read_with`] takes its own only if none ended during it.
    reads: u64,
}

impl Vmas {
    /// No mappings counted, no page on a frame; a refusal reads the mappings again if
    /// the last read is older than `exact_every`, a report past the slack if older than
    /// `report_stale`.
    pub(crate) const fn new(exact_every: Duration, report_stale: Duration) -> Vmas {
        Vmas {
            exact_every,
            report_stale,
            added: AtomicUsize::new(0),
            count: Mutex::new(Count {
                seen: 0,
                read_at: None,
                reserved: 0,
                reads: 0,
            }),
        }
    }

    /// The process's mappings, read again if the last read is over [`MAPS_STALE`] old, or
    /// over [`REPORT_STALE`] old when the agents changed more than [`REPORT_SLACK`] / 2
    /// mappings since: what the agent reports each second (memfoldd's books and its VMA
    /// warning; no decision takes it). The hot-plug watch's reads (at least every
    /// [`crate::regions::WATCH_BACKSTOP`]) come here ([`Vmas::read_with`]), so a report
    /// reads on its own only when its count could be off by more than the slack: reading
    /// each second for it was half the agents' reads of the file, ~1.5 CPU s per 90 s
    /// over four QEMUs of 3 900–6 400 mappings each (perf, docs/peer.md, "Where
    /// memfold's CPU goes with frames paged out"). The upper bound (the last read plus the
    /// agents' changes since) grows by 2 with each change, and memfoldd's take-backs
    /// under VMA pressure make thousands a second, which took a 4 GiB guest's reported
    /// count past `vm.max_map_count` (68 567) when it went unread: with that many
    /// changes a read at most [`REPORT_STALE`] old bounds it.
    /// The report's own read runs outside the lock ([`Vmas::read_with`]), as the watch's
    /// does: under it, every CoW break ([`Vmas::break_fits`]) would wait the read's
    /// milliseconds.
    pub(crate) fn mappings_read(&self, read_maps: impl Fn() -> Option<usize>) -> usize {
        let stale = {
            let c = self.count.lock().unwrap_or_else(|e| e.into_inner());
            let max_age = if self.added.load(Ordering::SeqCst) > REPORT_SLACK {
                self.report_stale
            } else {
                MAPS_STALE
            };
            c.older_than(max_age)
        };
        if stale {
            let _ = self.read_with(|| read_maps().map(|n| (n, ())));
        }
        let c = self.count.lock().unwrap_or_else(|e| e.into_inner());
        c.seen + self.added.load(Ordering::SeqCst)
    }

    /// Takes a read of the mappings made by another reader of `/proc/self/maps` (the
    /// hot-plug watch, which needs the text too): `read_maps` returns the count of
    /// mappings and what else it read, or `None` if the read failed (the count is then
    /// left as it was). The read runs outside the lock, so that no share admission or
    /// CoW break ([`Vmas::break_fits`]) waits for it; its count replaces the last only if
    /// no other read ended meanwhile (whose count is as fresh, and whose subtraction of
    /// the changes it saw would otherwise be made twice, undercounting).
    pub(crate) fn read_with<T>(&self, read_maps: impl FnOnce() -> Option<(usize, T)>) -> Option<T> {
        let (last, before) = {
            let c = self.count.lock().unwrap_or_else(|e| e.into_inner());
            (c.reads, self.added.load(Ordering::SeqCst))
        };
        let started = Instant::now();
        let (seen, out) = read_maps()?;
        let mut c = self.count.lock().unwrap_or_else(|e| e.into_inner());
        if c.reads == last {
            self.take_read(&mut c, seen, before, started);
        }
        Some(out)
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
        read_maps: impl Fn() -> Option<usize>,
    ) -> Admission<'_> {
        let mut c = self.count.lock().unwrap_or_else(|e| e.into_inner());
        let shares = budget - budget / 8;
        let mut room = self.room(&mut c, shares, false, &read_maps);
        if want > room {
            // Refused only on an exact count.
            room = self.room(&mut c, shares, true, &read_maps);
        }
        let pages = want.min(room);
        c.reserved += 3 * pages;
        Admission {
            vmas: self,
            pages,
            reserved: 3 * pages,
        }
    }

    /// Whether a CoW break may map one guest page back over a run of shared pages (+2
    /// mappings) within `budget`: `M + R + 2 ≤ budget` on the count, read again (at most
    /// once per `exact_every`) before saying no. No: the break un-shares its whole run
    /// instead, which adds no mapping (the module docs).
    pub(crate) fn break_fits(&self, budget: usize, read_maps: impl Fn() -> Option<usize>) -> bool {
        let mut c = self.count.lock().unwrap_or_else(|e| e.into_inner());
        self.refresh(&mut c, MAPS_STALE, &read_maps);
        if self.used(&c) + 2 <= budget {
            return true;
        }
        self.refresh(&mut c, self.exact_every, &read_maps);
        self.used(&c) + 2 <= budget
    }

    /// Pages a share may still map: `(limit − M − R) / 3`, `M` read again when stale, or
    /// when `exact` and older than `exact_every`.
    fn room(
        &self,
        c: &mut Count,
        limit: usize,
        exact: bool,
        read_maps: &impl Fn() -> Option<usize>,
    ) -> usize {
        let max_age = if exact { self.exact_every } else { MAPS_STALE };
        self.refresh(c, max_age, read_maps);
        limit.saturating_sub(self.used(c)) / 3
    }

    /// `M + R` as counted: the last read plus the agents' changes since, and the room
    /// reserved.
    fn used(&self, c: &Count) -> usize {
        c.seen + self.added.load(Ordering::SeqCst) + c.reserved
    }

    /// Reads the mappings again when the last read is over `max_age` (at most
    /// [`MAPS_STALE`]) old. A failed read (`None`) leaves the count as it was: the last
    /// read plus every change since is still an upper bound, where taking 0 (as before
    /// 2026-12-03) dropped the count under the true one and could admit shares past the
    /// budget.
    fn refresh(&self, c: &mut Count, max_age: Duration, read_maps: &impl Fn() -> Option<usize>) {
        if c.older_than(max_age) {
            let started = Instant::now();
            let before = self.added.load(Ordering::SeqCst);
            if let Some(seen) = read_maps() {
                self.take_read(c, seen, before, started);
            }
        }
    }

    /// Takes a read of `seen` mappings, started at `started` when the agents' changes
    /// counted `before`: the count becomes `seen` plus only the changes made since the
    /// read began (those made while reading stay counted, twice if the read saw them:
    /// more, never fewer), and the read's age runs from its start. The one place the
    /// count is replaced ([`Vmas::refresh`], [`Vmas::read_with`]); under the lock.
    fn take_read(&self, c: &mut Count, seen: usize, before: usize, started: Instant) {
        c.seen = seen;
        self.added.fetch_sub(before, Ordering::SeqCst);
        c.read_at = Some(started);
        c.reads += 1;
    }
}

/// Mappings left to QEMU's own use (threads, libraries, TCG buffers) below
/// `vm.max_map_count`: the budget of shares and breaks is the limit less these.
pub(crate) const QEMU_OWN: usize = 4096;

/// The VMA budget: fixed (`MEMFOLD_VMA_BUDGET`), or `vm.max_map_count` less
/// [`QEMU_OWN`], the limit read again when over [`MAPS_STALE`] old, so that a limit the
/// operator raises while QEMU runs (`memfoldd --max-map-count`, issue 19) lets running
/// guests map more within seconds. A lowered limit lowers the budget the same way: shares
/// stop, and breaks past it un-share whole runs (the module docs).
pub(crate) struct Budget {
    fixed: Option<usize>,
    read_limit: fn() -> u64,
    every: Duration,
    /// The budget last computed and when the limit was read; `None`: never.
    last: std::cell::Cell<Option<(usize, Instant)>>,
}

impl Budget {
    /// `fixed` if given, else from `read_limit` (the kernel's `vm.max_map_count`), read at
    /// most once per `every`.
    pub(crate) fn new(fixed: Option<usize>, read_limit: fn() -> u64, every: Duration) -> Self {
        Budget {
            fixed,
            read_limit,
            every,
            last: std::cell::Cell::new(None),
        }
    }

    /// Most mappings shares and breaks may bring this process to.
    pub(crate) fn get(&self) -> usize {
        if let Some(b) = self.fixed {
            return b;
        }
        if let Some((b, at)) = self.last.get() {
            if at.elapsed() <= self.every {
                return b;
            }
        }
        let limit = usize::try_from((self.read_limit)()).unwrap_or(usize::MAX);
        let b = limit.saturating_sub(QEMU_OWN);
        self.last.set(Some((b, Instant::now())));
        b
    }
}

impl Count {
    /// Whether the last read is over `max_age` (at most [`MAPS_STALE`]) old, or none was
    /// made: when [`Vmas::refresh`] and [`Vmas::mappings_read`] read again.
    fn older_than(&self, max_age: Duration) -> bool {
        self.read_at
            .is_none_or(|t| t.elapsed() > max_age.min(MAPS_STALE))
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

/// This process's mappings now: the lines of `/proc/self/maps`; `None` if it cannot be read.
/// Costs milliseconds for a QEMU with thousands of shared runs (docs/peer.md, "CPU of
/// sharing alone"), hence [`MAPS_STALE`].
pub(crate) fn read_self_maps() -> Option<usize> {
    std::fs::read("/proc/self/maps")
        .ok()
        .map(|m| count_mappings(&m))
}

/// Mappings listed in the text of a `/proc/PID/maps`: one a line.
pub(crate) fn count_mappings(maps: &[u8]) -> usize {
    maps.iter().filter(|&&b| b == b'\n').count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shares stop at seven eighths of the budget, whatever their pages: pages on frames
    /// cost no room (a break at the budget un-shares its run instead of splitting it),
    /// and a share in progress in one region holds its room from the other. Breaks fit
    /// until the mappings reach the budget itself.
    #[test]
    fn shares_leave_an_eighth_to_breaks_and_pages_on_frames_cost_no_room() {
        let vmas = Vmas::new(Duration::ZERO, REPORT_STALE);
        let budget = 160;
        let m = std::cell::Cell::new(10);
        let maps = || Some(m.get());
        // (160 − 20 − 10) / 3 = 43.
        let first = vmas.admit(budget, 64, maps);
        assert_eq!(first.pages, 43);
        // While region A's share is in progress, its room is held from region B.
        assert_eq!(vmas.admit(budget, 60, maps).pages, 0);
        drop(first);
        // Shared as one run: one mapping more. 43 pages on frames take no room.
        m.set(11);
        assert_eq!(vmas.admit(budget, 64, maps).pages, 43);
        // 70 one-page breaks (2 mappings each on the count; 150 in fact): no room for
        // shares, but breaks still fit, up to the budget itself.
        for _ in 0..70 {
            vmas.changed();
        }
        m.set(150);
        assert_eq!(vmas.admit(budget, 1, maps).pages, 0);
        assert!(vmas.break_fits(budget, maps));
        for _ in 0..5 {
            vmas.changed();
        }
        m.set(159);
        assert!(!vmas.break_fits(budget, maps), "159 + 2 > 160");
    }

    /// The agents' changes since the last read count until the next read, which replaces
    /// them; a stale count is read again only before refusing.
    #[test]
    fn changes_count_until_the_next_read() {
        let vmas = Vmas::new(Duration::ZERO, REPORT_STALE);
        let reads = std::cell::Cell::new(0);
        let maps = || {
            reads.set(reads.get() + 1);
            Some(10)
        };
        assert_eq!(vmas.admit(100, 1, maps).pages, 1);
        assert_eq!(reads.get(), 1);
        for _ in 0..15 {
            vmas.changed();
        }
        // Shares stop at 100 − 12 = 88; 10 + 30 used: 16 pages of room without reading;
        // 26 asked for: read again.
        assert_eq!(vmas.admit(100, 16, maps).pages, 16);
        assert_eq!(reads.get(), 1);
        assert_eq!(vmas.admit(100, 26, maps).pages, 26);
        assert_eq!(reads.get(), 2);
    }

    /// Without a fixed budget, the budget follows `vm.max_map_count` (less QEMU's own
    /// room), read again once the last read is stale: a limit raised while QEMU runs
    /// admits shares the old one refused.
    #[test]
    fn a_raised_limit_admits_shares_the_old_one_refused() {
        static LIMIT: AtomicUsize = AtomicUsize::new(4096 + 160);
        let read = || LIMIT.load(Ordering::SeqCst) as u64;
        let budget = Budget::new(None, read, Duration::ZERO);
        let vmas = Vmas::new(Duration::ZERO, REPORT_STALE);
        let maps = || Some(140);
        assert_eq!(budget.get(), 160);
        // Shares stop at 160 − 20 = 140: none admitted.
        assert_eq!(vmas.admit(budget.get(), 10, maps).pages, 0);
        LIMIT.store(4096 + 1600, Ordering::SeqCst);
        assert_eq!(budget.get(), 1600);
        assert_eq!(vmas.admit(budget.get(), 10, maps).pages, 10);
        // Read at most once per `every`; a fixed budget is never read.
        let slow = Budget::new(None, read, Duration::from_secs(3600));
        assert_eq!(slow.get(), 1600);
        LIMIT.store(4096 + 10, Ordering::SeqCst);
        assert_eq!(slow.get(), 1600, "read again only when stale");
        assert_eq!(budget.get(), 10, "a lowered limit lowers the budget too");
        assert_eq!(Budget::new(Some(77), read, Duration::ZERO).get(), 77);
    }

    /// At the budget, refusals read the mappings at most once per `exact_every`, each
    /// refusal still on a count that is an upper bound.
    #[test]
    fn refusals_at_the_budget_read_the_mappings_once_a_second_not_each_time() {
        let vmas = Vmas::new(Duration::from_secs(3600), REPORT_STALE);
        let reads = std::cell::Cell::new(0);
        let maps = || {
            reads.set(reads.get() + 1);
            Some(95)
        };
        // Shares stop at 112 − 14 = 98: (98 − 95) / 3 = 1 page of room. A share of 2
        // reads once (its count is fresh for the exact check too) and gets 1.
        let first = vmas.admit(112, 2, maps);
        assert_eq!((first.pages, reads.get()), (1, 1));
        // Held: nothing left, and a thousand refusals read nothing more.
        for _ in 0..1000 {
            assert_eq!(vmas.admit(112, 1, maps).pages, 0);
        }
        assert_eq!(reads.get(), 1);
        drop(first);
        assert_eq!(vmas.admit(112, 1, maps).pages, 1, "its room given back");
        // With exact_every 0, each refusal reads again (the old behaviour).
        let eager = Vmas::new(Duration::ZERO, REPORT_STALE);
        let full = || {
            reads.set(reads.get() + 1);
            Some(98)
        };
        reads.set(0);
        for _ in 0..5 {
            assert_eq!(eager.admit(112, 1, full).pages, 0);
        }
        assert_eq!(reads.get(), 6, "the first read and one per refusal");
    }

    /// The hot-plug watch's read serves the report: no read of its own while it is
    /// fresh, its count plus the changes made since (those made during the read too).
    #[test]
    fn the_report_takes_the_watchs_read() {
        let vmas = Vmas::new(Duration::ZERO, REPORT_STALE);
        for _ in 0..5 {
            vmas.changed();
        }
        let got = vmas.read_with(|| {
            vmas.changed();
            Some((40, "maps text"))
        });
        assert_eq!(got, Some("maps text"));
        assert_eq!(
            vmas.mappings_read(|| panic!("the report read on its own")),
            42
        );
        vmas.changed();
        assert_eq!(
            vmas.mappings_read(|| panic!("the report read on its own")),
            44
        );
        // A failed read leaves the count as it was.
        assert_eq!(vmas.read_with(|| None::<(usize, ())>), None);
        assert_eq!(
            vmas.mappings_read(|| panic!("the report read on its own")),
            44
        );
    }

    /// A read that ends while the watch reads wins: the watch's count is dropped, and the
    /// changes the watch saw at its start are not subtracted a second time (which would
    /// wrap the count and refuse every share).
    #[test]
    fn a_read_ending_during_the_watchs_is_not_undone() {
        let vmas = Vmas::new(Duration::ZERO, REPORT_STALE);
        for _ in 0..5 {
            vmas.changed();
        }
        let reads = std::cell::Cell::new(0);
        let got = vmas.read_with(|| {
            vmas.changed();
            // Never read before: the report reads now, 50 mappings, changes replaced.
            let n = vmas.mappings_read(|| {
                reads.set(reads.get() + 1);
                Some(50)
            });
            assert_eq!(n, 50);
            Some((40, ()))
        });
        assert_eq!((got, reads.get()), (Some(()), 1));
        assert_eq!(vmas.mappings_read(|| panic!("read again")), 50);
        assert_eq!(vmas.admit(1000, 10, || panic!("read again")).pages, 10);
    }

    /// A failed read of the mappings leaves the count (the last read plus the changes
    /// since) as it was: taken for 0, it admitted shares and breaks past the budget.
    #[test]
    fn a_failed_read_keeps_the_count() {
        let vmas = Vmas::new(Duration::ZERO, REPORT_STALE);
        assert_eq!(vmas.mappings_read(|| Some(100)), 100);
        for _ in 0..5 {
            vmas.changed();
        }
        // Shares stop at 200 − 25 = 175; 110 used: 21 pages. Asked 100, the exact read
        // fails: still 21.
        assert_eq!(vmas.admit(200, 100, || None).pages, 21);
        assert!(vmas.break_fits(112, || None), "110 + 2 <= 112");
        assert!(!vmas.break_fits(111, || None), "110 + 2 > 111, read or not");
        assert_eq!(vmas.mappings_read(|| None), 110);
    }

    /// The report reads on its own only when the agents' changes since the last read
    /// could put its count more than the slack over the true one (here at once: its
    /// staleness past the slack is 0); under it, a read up to `MAPS_STALE` old serves.
    #[test]
    fn the_report_reads_on_its_own_only_past_the_slack() {
        let vmas = Vmas::new(Duration::ZERO, Duration::ZERO);
        let reads = std::cell::Cell::new(0);
        let maps = || {
            reads.set(reads.get() + 1);
            Some(1000)
        };
        assert_eq!(vmas.mappings_read(maps), 1000);
        for _ in 0..REPORT_SLACK / 2 {
            vmas.changed();
        }
        assert_eq!(vmas.mappings_read(maps), 1000 + REPORT_SLACK);
        assert_eq!(reads.get(), 1, "within the slack: no read");
        vmas.changed();
        assert_eq!(vmas.mappings_read(maps), 1000, "past it: read again");
        assert_eq!(reads.get(), 2);
        // Read outside the lock: a CoW break's check meanwhile does not wait for it.
        for _ in 0..=REPORT_SLACK / 2 {
            vmas.changed();
        }
        let outside = || {
            reads.set(reads.get() + 1);
            assert!(
                vmas.count.try_lock().is_ok(),
                "the report reads under the lock"
            );
            Some(1000)
        };
        assert_eq!(vmas.mappings_read(outside), 1000);
        assert_eq!(reads.get(), 3);
    }
}
