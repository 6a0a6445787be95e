//! Page faults on guest RAM, served by where the faulting page lives ([`PageHome`]):
//!
//! | fault | `Private` | `Zero` | `Frame` | `Stashed` |
//! |---|---|---|---|---|
//! | minor (armed by the clock) | R (M on a write), `UFFDIO_CONTINUE` | wake; filled: refill, `UFFDIO_CONTINUE` | wake | wake; filled: fail closed |
//! | write-protect | M, unprotect | M, unprotect | CoW break (and break-ahead: [`BREAK_AHEAD`]) | M, unprotect |
//! | missing | zeros (first touch) | zeros, refill | wake | decode the blob; filled: fail closed |
//!
//! Minor faults come only in the clock's `userfault` mode (`ClockRBits::Userfault`, guest
//! RAM registered for them); in its `pagemap` mode an armed page's first access is the
//! kernel's own minor fault, read back as R at the next clock scan, and the "filled" cases
//! below go unseen: the guest reads the memfd's bytes (docs/security.md).
//!
//! "wake" lets the thread retry: the page changed home since it faulted. "filled": the
//! guest memfd holds data at a page the agent holds as a hole, so it was written outside
//! QEMU's mapping (`pwrite`, a second mapping: a vhost-user backend); a wake would only
//! bring the same minor fault back, forever. A zero page so written is exactly the
//! memfd's bytes; a stored one is no page the guest ever wrote (docs/security.md, "Writes
//! that bypass the page tables"). A `Frame` page takes no minor fault: the pool mapping
//! over it is registered for write-protect faults only (`install`), so one read there is
//! from before the share. A read is
//! answered write-protected (`UFFDIO_CONTINUE` / `UFFDIO_COPY` with `MODE_WP`), so that a
//! later write still sets M. Every fault is answered by this thread, from descriptors the
//! agent holds (guest memfd, pool, store, swap file), so guests stay correct without
//! memfoldd.

use std::io;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use memfold_codecs::page_checksum;
use memfold_codecs::{Page, PAGE_SIZE};
use memfold_ids::{FrameId, Gfn};
use memfold_sys::memfd::{drop_cache, next_data_run, pread_exact, pread_within, pwrite_all};
use memfold_sys::uffd::Event;
use memfold_wire::BlobHome;

use crate::state::{plus, PageHome, Stash};
use crate::{Agent, PAGE};

/// How long one fault may keep failing before the agent fails closed.
pub(crate) const FAULT_GIVE_UP: Duration = Duration::from_secs(30);

/// Pages a sequential writer's CoW break breaks ahead of it, at most: a device filling a
/// buffer of shared pages (a disk read into page cache or an `O_DIRECT` buffer the scan
/// shared while it sat idle) faults page after page, and each fault is a round trip
/// through this thread — ~120 µs a page on a busy two-core host (docs/sharing-at-read.md)
/// for a ~10 µs break. The kernel's fault-around maps ahead of a reader the same way.
pub(crate) const BREAK_AHEAD: usize = 32;

/// Two CoW breaks of adjacent pages at most this far apart are a sequential writer.
pub(crate) const SEQUENTIAL_WITHIN: Duration = Duration::from_millis(2);

impl Agent {
    /// Handles a fault; a failure (the host out of memory for the private copy, the VMA
    /// limit) is logged and retried with back-off: the faulting thread waits, it never sees
    /// a wrong byte. A fault that still fails after [`FAULT_GIVE_UP`], on a blob that no
    /// longer decodes to its page, or on a stored page written outside QEMU's mapping,
    /// fails closed ([`crate::fail_closed`]: QEMU paused, or aborted) rather than spin
    /// forever or let the guest run on unprotected.
    pub(crate) fn handle_or_retry(&mut self, ev: Event) {
        let mut delay = Duration::from_millis(1);
        let started = std::time::Instant::now();
        while let Err(e) = self.handle(ev) {
            // Unplugged: `serve` detaches next, and closing the userfaultfd wakes it.
            if self.gone.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            // A blob that no longer decodes to its page will not on a retry either.
            if e.kind() == io::ErrorKind::InvalidData {
                self.fail_closed(&format!("fault {ev:?}: {e}"));
            }
            if started.elapsed() > FAULT_GIVE_UP {
                self.fail_closed(&format!(
                    "fault {ev:?} still fails after {FAULT_GIVE_UP:?}: {e}"
                ));
            }
            tracing::error!("fault {ev:?}: {e}; retrying");
            std::thread::sleep(delay);
            delay = (delay * 2).min(Duration::from_secs(1));
        }
    }

    /// Handles one event: a fault by where its page lives (the table above), a discarded
    /// range ([`Agent::discard`]); other events need nothing but being read.
    fn handle(&mut self, ev: Event) -> io::Result<()> {
        if let Event::Remove { start, end } = ev {
            self.discard(start, end);
            return Ok(());
        }
        let Event::Fault {
            addr,
            wp,
            write,
            minor,
            tid,
        } = ev
        else {
            return Ok(()); // reading a remap event is all it needs
        };
        let started = Instant::now();
        let page = addr & !(PAGE - 1);
        if page < self.base || page >= self.base + self.ram_bytes {
            return Ok(self.uffd.wake(page, PAGE)?);
        }
        let gfn = Gfn(((page - self.base) / PAGE) as u32);
        let home = self.pages.home(gfn);
        if minor {
            match home {
                PageHome::Private => {}
                // A minor fault means the memfd holds the page, yet the agent holds it as
                // a hole: written outside QEMU's mapping (`pwrite`, a second mapping).
                // Onto a zero page, so the memfd's bytes are the page: a refill.
                PageHome::Zero if self.holds_data(gfn) => {
                    self.pages.set(gfn, PageHome::Private);
                    self.pending.refills.push(gfn);
                }
                // Onto a stored page: the unwritten bytes read as the hole's zeros, and the
                // write cannot be merged with the blob. No page is right to give the guest.
                PageHome::Stashed(_) if self.holds_data(gfn) => {
                    return Err(bypass_written(gfn));
                }
                // Read before a share, reclaim or stash changed the page (punched since,
                // or a pool mapping now; pool mappings take no minor faults): retry on
                // the new state.
                _ => return Ok(self.uffd.wake(page, PAGE)?),
            }
            // First access since the clock armed the page: R, and M for a write. A read
            // maps it write-protected, so that a later write still sets M.
            self.counters.minor_faults += 1;
            self.pages.mark(gfn, write);
            match self.uffd.cont(page, PAGE, !write) {
                // Punched outside since the fault (a balloon's or virtio-mem's discard:
                // no event): nothing to map, and the same fault would fail for good.
                // Woken, the access faults again as missing: the hole's zeros.
                Err(e) if e.raw_os_error() == Some(libc::EFAULT) && !self.holds_data(gfn) => {
                    self.uffd.wake(page, PAGE)?;
                }
                r => r?,
            }
            self.counters.track.record(started.elapsed(), 1);
            return Ok(());
        }
        if wp {
            self.counters.wp_faults += 1;
            return match home {
                // Armed by the clock, or protected for a share, reclaim or stash attempt
                // that has ended: let it write (a reclaimed or stashed page then faults
                // as missing).
                PageHome::Private | PageHome::Zero | PageHome::Stashed(_) => {
                    self.pages.mark(gfn, true);
                    self.unprotect(page, PAGE)?;
                    // M tracking is the clock's too: its wait counts with the R faults'.
                    self.counters.track.record(started.elapsed(), 1);
                    Ok(())
                }
                PageHome::Frame(frame) => {
                    // A writer's call that overwrites it whole: no copy, and its other
                    // pages on frames broken with it (`nocopy.rs`).
                    let declared = self.declared_whole(tid, page);
                    match &declared {
                        Some(runs) => self.break_declared(gfn, frame, runs)?,
                        None => self.cow_break(gfn, frame)?,
                    }
                    self.counters.cow.record(started.elapsed(), 1);
                    if declared.is_none() {
                        self.break_ahead(gfn);
                    }
                    Ok(())
                }
            };
        }
        self.counters.missing_faults += 1;
        match home {
            PageHome::Stashed(stash) => {
                self.unstash(gfn, &stash, write)?;
                self.counters.unstash.record(started.elapsed(), 1);
                Ok(())
            }
            PageHome::Private | PageHome::Zero => {
                // A hole reads as zeros: a first touch, or a reclaimed zero page. A read
                // gets it write-protected, so that a later write still sets M. Its R is
                // set here, so the pagemap clock must not count it again when it finds
                // the page present.
                self.pages.mark(gfn, write);
                self.pages.unzap(gfn);
                if write {
                    self.uffd.zeropage(page, PAGE)?;
                } else {
                    self.uffd.copy(page, &[0u8; PAGE_SIZE], true)?;
                }
                if home == PageHome::Zero {
                    self.pages.set(gfn, PageHome::Private);
                    self.pending.refills.push(gfn);
                }
                self.counters.fault.record(started.elapsed(), 1);
                Ok(())
            }
            PageHome::Frame(_) => Ok(self.uffd.wake(page, PAGE)?), // pool frames are never holes
        }
    }

    /// Copy-on-write break: the guest gets a private copy of the frame's bytes. Maps
    /// guest RAM back over the one page while the VMA budget has room for the two
    /// mappings that may add ([`crate::vmas::Vmas::break_fits`]); past it, or when the
    /// kernel refuses the mapping, breaks the page's whole run instead
    /// ([`Agent::cow_break_run`]), which adds none.
    pub(crate) fn cow_break(&mut self, gfn: Gfn, frame: FrameId) -> io::Result<()> {
        if !crate::vmas::PROCESS.break_fits(self.vma_budget.get(), crate::vmas::read_self_maps) {
            return self.cow_break_run(gfn, frame);
        }
        self.copy_frames(gfn, frame, 1)?;
        if let Err(e) = self.map_guest_page(gfn) {
            tracing::warn!("{e}; breaking its whole run instead");
            return self.cow_break_run(gfn, frame);
        }
        self.broken([(gfn, frame)]);
        self.install_written(gfn, 1);
        Ok(self.uffd.wake(self.page_addr(gfn), PAGE)?)
    }

    /// Pages `[first, first + n)`, private copies just mapped back (CoW breaks), are
    /// marked R and M, as written, and installed writable now: in the clock's `userfault`
    /// mode guest RAM is registered for minor faults, so without this the writer's retry
    /// of its write would be a second round trip through this thread (a minor fault on a
    /// page the memfd holds) for every break. Call before waking the writer (a thread
    /// woken first may take that minor fault anyway; `UFFDIO_CONTINUE` then finds the
    /// page mapped and only wakes). Marking M also clears the pages' watch bits
    /// (the free-page discard's invariant: a page installed writable is never discarded
    /// as unwritten). In the `pagemap` mode the kernel maps them on the retry itself and
    /// only the marks are made. A failed `UFFDIO_CONTINUE` only leaves the retry's minor
    /// fault.
    pub(crate) fn install_written(&mut self, first: Gfn, n: usize) {
        // M in both modes: in the `pagemap` mode the retry's write is the kernel's, on a
        // fresh mapping without write-protection, so no fault would ever tell.
        for k in 0..n {
            self.pages.mark(plus(first, k), true);
        }
        if self.rbits.is_some() {
            return;
        }
        if let Err(e) = self
            .uffd
            .cont(self.page_addr(first), n as u64 * PAGE, false)
        {
            tracing::debug!("installing {n} broken pages from {first}: {e}");
        }
    }

    /// Copy-on-write break of page `gfn` (on `frame`) and of every page of its run: the
    /// pages around it on consecutive frames, which is a union of whole pool mappings (a
    /// mapping maps consecutive pool offsets; the pages just outside the run are not on
    /// the next frame, so not in its mappings). Guest RAM mapped back over whole mappings
    /// adds none, so the break never needs room the VMA budget does not have (`vmas.rs`).
    /// The price: the run's other pages are private copies too, each reported as a break.
    ///
    /// Errors: the pool or guest memfd cannot be read or written, or the mapping fails
    /// (nothing changed: every page still on its frame).
    pub(crate) fn cow_break_run(&mut self, gfn: Gfn, frame: FrameId) -> io::Result<()> {
        let (first, frame0, n) = self.pages.frame_run(gfn, frame);
        self.copy_frames(first, frame0, n)?;
        self.map_guest_range(first, n)?;
        self.broken((0..n).map(|k| (plus(first, k), FrameId(frame0.0 + k as u32))));
        // Only the faulting page is written; the run's others fault as any armed page.
        self.install_written(gfn, 1);
        self.counters.run_breaks += 1;
        Ok(self.uffd.wake(self.page_addr(first), n as u64 * PAGE)?)
    }

    /// After the CoW break of page `gfn`: if the last break was of the page next to it,
    /// moments ago ([`SEQUENTIAL_WITHIN`]), a writer is going through the pages in that
    /// direction, and the pages after `gfn` in it that are on frames — up to
    /// [`BREAK_AHEAD`], stopping at the first that is not — are broken now, in one
    /// mapping, as if written: each a private copy of its frame, reported as a break. No
    /// thread waits on them, so nothing fails here: where the VMA budget has no room or a
    /// copy or the mapping fails, they stay on their frames (a copy already written to
    /// the memfd is punched out again).
    ///
    /// Only pages on frames are mapped over: guest RAM mapped back over a private page
    /// would drop its write-protection (the clock's M, a free-page watch, a share's
    /// check under way), and over a stashed one the hole that says it is stored.
    fn break_ahead(&mut self, gfn: Gfn) {
        let now = Instant::now();
        let dir: i64 = match self.last_break {
            Some((g, t)) if now.duration_since(t) <= SEQUENTIAL_WITHIN => gfn.0 as i64 - g.0 as i64,
            _ => 0,
        };
        self.last_break = Some((gfn, now));
        if dir != 1 && dir != -1 {
            return;
        }
        let mut ahead: Vec<(Gfn, FrameId)> = Vec::new();
        let mut g = gfn.0 as i64;
        while ahead.len() < BREAK_AHEAD {
            g += dir;
            match u32::try_from(g).ok().and_then(|g| self.pages.get(Gfn(g))) {
                Some(PageHome::Frame(f)) => ahead.push((Gfn(g as u32), f)),
                _ => break,
            }
        }
        let Some(&(far, _)) = ahead.last() else {
            return;
        };
        if !crate::vmas::PROCESS.break_fits(self.vma_budget.get(), crate::vmas::read_self_maps) {
            return;
        }
        let first = if dir > 0 { ahead[0].0 } else { far };
        let copied = ahead
            .iter()
            .all(|&(g, f)| self.copy_frames(g, f, 1).is_ok());
        if !copied || self.map_guest_range(first, ahead.len()).is_err() {
            // Still on their frames; the copies only held memory.
            self.punch(first, ahead.len() as u64);
            return;
        }
        self.broken(ahead.iter().copied());
        // The writer is expected to write them next: no minor fault each on its way.
        self.install_written(first, ahead.len());
        self.counters.ahead_breaks += ahead.len() as u64;
        self.last_break = Some((far, now));
    }

    /// Copies frames `[frame0, frame0 + n)` into guest RAM's memfd at pages
    /// `[first, first + n)`, the first half of a CoW break: the pages stay mapped onto
    /// their write-protected frames meanwhile.
    ///
    /// Errors: the pool cannot be read or the memfd written.
    pub(crate) fn copy_frames(&self, first: Gfn, frame0: FrameId, n: usize) -> io::Result<()> {
        const CHUNK: usize = 64;
        let mut buf = vec![0u8; n.min(CHUNK) * PAGE_SIZE];
        let mut k = 0;
        while k < n {
            let m = (n - k).min(CHUNK);
            let bytes = &mut buf[..m * PAGE_SIZE];
            pread_within(self.pool()?, bytes, FrameId(frame0.0 + k as u32).offset())?;
            pwrite_all(self.memfd.as_fd(), bytes, plus(first, k).offset())?;
            k += m;
        }
        Ok(())
    }

    /// `pages`, each (page, the frame it was on), guest RAM mapped back over them, are
    /// private: each is recorded as a break of its frame. The caller wakes the threads
    /// waiting on them.
    pub(crate) fn broken(&mut self, pages: impl IntoIterator<Item = (Gfn, FrameId)>) {
        for (g, f) in pages {
            self.pages.set(g, PageHome::Private);
            self.pending.breaks.push((g, f));
        }
    }

    /// A missing fault on a stashed page: decode it and install it (write-protected for a
    /// read, so that a later write still sets M). On error the page stays stashed; the
    /// memfd written at the page since it was stashed is an `InvalidData` error.
    pub(crate) fn unstash(&mut self, gfn: Gfn, stash: &Stash, write: bool) -> io::Result<()> {
        // Filled since it was stashed: `UFFDIO_COPY` would find the page present and map
        // the memfd's bytes, not the stored page.
        if self.holds_data(gfn) {
            return Err(bypass_written(gfn));
        }
        let mut page = [0u8; PAGE_SIZE];
        self.decode_stashed(gfn, stash, &mut page)?;
        self.uffd.copy(self.page_addr(gfn), &page, !write)?;
        self.pages.set(gfn, PageHome::Private);
        self.pages.mark(gfn, write);
        self.pending.unstashed.push(gfn);
        Ok(())
    }

    /// Whether the guest memfd holds data (not a hole) at page `gfn` now (`SEEK_DATA`).
    pub(crate) fn holds_data(&self, gfn: Gfn) -> bool {
        next_data_run(self.memfd.as_fd(), gfn, plus(gfn, 1)).is_some()
    }

    /// Decodes the blob of stashed page `gfn` (from the store or the swap file; for a
    /// patch with its pool reference frame) into `out`, and checks it against the
    /// stash's checksum. A stash without one (the identical patch as the page table keeps
    /// it) is its reference frame's bytes, copied unchecked ([`Agent::decode_identical`]).
    ///
    /// Errors: no store, swap file or pool, a blob over a page or at an offset the stash
    /// table cannot keep ([`MAX_BLOB_OFFSET`](crate::state::MAX_BLOB_OFFSET)), a read
    /// failed, or the blob does not decode (a corrupt store: the page is then never
    /// installed).
    pub(crate) fn decode_stashed(&self, gfn: Gfn, s: &Stash, out: &mut Page) -> io::Result<()> {
        let Some(sum) = s.checksum else {
            return self.decode_identical(gfn, s, out);
        };
        let store = match s.home {
            BlobHome::Store => &self.store,
            BlobHome::Swap => &self.swap,
        };
        let store = store.as_ref().ok_or_else(|| {
            // Never comes back: a fault would retry it for nothing.
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{gfn}: stashed page without its store"),
            )
        })?;
        // No blob is longer than the page it holds: never allocate what memfoldd says.
        if s.len as usize > PAGE_SIZE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{gfn}: a stored blob of {} bytes, over a page", s.len),
            ));
        }
        // Where the stash table cannot keep it: refused here, before any record is made.
        use crate::state::{keeps_offset, BLOB_ALIGN, MAX_BLOB_OFFSET};
        if !keeps_offset(s.offset) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{gfn}: a blob at byte {} of its file: the stash table keeps multiples \
                     of {BLOB_ALIGN} below {MAX_BLOB_OFFSET}",
                    s.offset
                ),
            ));
        }
        let mut buf = [0u8; PAGE_SIZE];
        let blob = &mut buf[..s.len as usize];
        pread_exact(store.as_fd(), blob, s.offset)?;
        if s.home == BlobHome::Swap {
            // Read once: keep it out of the host's page cache.
            drop_cache(store.as_fd(), s.offset, s.len as u64);
        }
        let Some(encoding) = s.blob.encoding() else {
            *out = (&*blob).try_into().map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{gfn}: raw page of {} bytes", s.len),
                )
            })?;
            return check_sum(gfn, sum, out);
        };
        let mut reference = [0u8; PAGE_SIZE];
        let has_ref = if let Some(r) = s.blob.reference() {
            pread_within(self.pool()?, &mut reference, r.offset())?;
            true
        } else {
            false
        };
        encoding
            .decode(blob, has_ref.then_some(&reference), out)
            .map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{gfn}: stored blob: {e}"),
                )
            })?;
        check_sum(gfn, sum, out)
    }

    /// Decodes stashed page `gfn` kept as the identical patch against frame f
    /// ([`Stash::identical`], no checksum kept): what the empty run-diff patch decodes to,
    /// f's bytes, read from the pool, with no checksum to check them against. As safe as
    /// a page mapped onto f, which has none either: the stash request decoded the patch,
    /// checked it against the request's checksum and compared it with the page's bytes
    /// under write-protection before the punch (`requests.rs`, `stash`), and no one
    /// writes a pool frame while a page refers to it (memfoldd holds a patch reference
    /// on it, and a restarted memfoldd keeps an adopted pool's frames until this agent
    /// has re-attached, after writing its stashed pages back; a guest's write is a CoW
    /// break or a decode, never a write into the frame). What it gives up: a checksum would
    /// also catch a frame changed by a bug in memfoldd's reference counts; a page mapped
    /// onto that frame would read the same change, unchecked, as it always has.
    ///
    /// Errors: `s` has no checksum but is not the identical patch (`InvalidData`: never
    /// made by the table), no pool, or the read failed.
    fn decode_identical(&self, gfn: Gfn, s: &Stash, out: &mut Page) -> io::Result<()> {
        let f = s.identical_to().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{gfn}: a stored blob without a checksum: {s:?}"),
            )
        })?;
        pread_within(self.pool()?, out, f.offset())
    }
}

/// The page decoded from a blob must be the page stored (`sum` its checksum): a blob
/// changed in its store or swap file, or a patch against a changed reference frame, is an
/// `InvalidData` error, never a page installed.
fn check_sum(gfn: Gfn, sum: u64, page: &Page) -> io::Result<()> {
    if page_checksum(page) == sum {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{gfn}: the decoded page does not match its checksum: its blob was changed"),
    ))
}

/// A stored page whose hole in the guest memfd was filled outside QEMU's mapping: an
/// `InvalidData` error, so that a fault on it, or its write-back before a re-attach,
/// fails closed at once (a retry finds the same; a write-back would undo the write).
pub(crate) fn bypass_written(gfn: Gfn) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!(
            "{gfn} is stored by memfold, but guest RAM's memfd was written at that page outside QEMU's mapping of it (pwrite, or a second mapping such as a vhost-user backend's): the write cannot be merged with the stored page, so the guest gets neither"
        ),
    )
}
