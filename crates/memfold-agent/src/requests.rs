//! memfoldd's requests ([`ToAgent`]) and their replies: share pages onto pool frames,
//! reclaim zero pages, stash pages as blobs (or move a stashed page's blob to the swap
//! file), report and re-arm a clock slice's R and M bits, and watch and discard pages
//! the guest reports free.
//!
//! Each request is a hint: the agent checks every page under write-protection (writers
//! wait) against what memfoldd read, carries out what still holds and answers, per page,
//! done, changed (the guest wrote it since) or refused.

use std::io;
use std::os::fd::AsFd;
use std::time::Instant;

use memfold_codecs::{Page, PAGE_SIZE};
use memfold_ids::{FrameId, Gfn};
use memfold_sys::memfd::{pread_exact, pread_within};
use memfold_wire::{BatchId, BlobHome, StashPage, ToAgent, ToDaemon, CLOCK_SLICE};

use crate::install::Job;
use crate::state::{plus, PageHome, Stash};
use crate::{vmas, Agent, PAGE};

/// A request's answer, page by page.
#[derive(Default)]
pub(crate) struct Outcome {
    /// Carried out: shared, reclaimed, stashed or paged out.
    pub(crate) done: Vec<Gfn>,
    /// Changed since memfoldd read them (left as they are); for a page-out, still in RAM
    /// (in use, mapped elsewhere, no swap).
    pub(crate) changed: Vec<Gfn>,
    /// Refused for another reason (not private, no pool, VMA budget, unreadable blob,
    /// paged out already).
    pub(crate) refused: Vec<Gfn>,
}

/// What a page must pass to be punched out as a zero page ([`Agent::punch_zero`]).
#[derive(Clone, Copy)]
enum Punch {
    /// Its bytes are all zero (a zero-page reclaim).
    IfZero,
    /// Its watch bit is still set (a free-page discard).
    IfWatched,
}

/// Bytes of a fill's nonce at the start of each page ([`ToAgent::Fill`]).
const NONCE: usize = 16;

/// What a page must hold to be mapped onto its frame.
#[derive(Clone, Copy)]
enum Expect {
    /// The frame's bytes (a share, ESX §4.3).
    Frame,
    /// A block device's nonce in its first [`NONCE`] bytes (a fill, Satori §5.2): the
    /// device wrote it and has not written the page since, so the read it stands for
    /// may be served by the frame.
    Nonce([u8; NONCE]),
}

impl Expect {
    /// The nonce `n` as the device wrote it (native byte order).
    fn nonce(n: [u64; 2]) -> Expect {
        let mut b = [0u8; NONCE];
        b[..8].copy_from_slice(&n[0].to_ne_bytes());
        b[8..].copy_from_slice(&n[1].to_ne_bytes());
        Expect::Nonce(b)
    }
}

impl Agent {
    /// Receives one request from memfoldd, carries it out and replies. End of connection
    /// or a bad message drops the connection.
    ///
    /// Errors: a mapping change or userfaultfd call failed midway (the caller drops the
    /// connection: the re-attach lists what is shared or reclaimed now).
    pub(crate) fn command(&mut self) -> io::Result<()> {
        let msg = match self.conn.as_ref().map(|c| c.recv::<ToAgent>()) {
            Some(Ok(Some((m, _)))) => m,
            Some(Ok(None)) | Some(Err(_)) | None => {
                self.conn = None;
                return Ok(());
            }
        };
        let started = Instant::now();
        let reply = match msg {
            ToAgent::Share { batch, pages } => {
                let o = self.share(pages, Expect::Frame)?;
                self.share_done(batch, started, o)
            }
            ToAgent::Fill {
                batch,
                pages,
                nonce,
            } => {
                // A zero nonce would match pages never written: refused whole.
                let o = if nonce == [0, 0] {
                    Outcome {
                        refused: pages.iter().map(|p| p.0).collect(),
                        ..Outcome::default()
                    }
                } else {
                    self.share(pages, Expect::nonce(nonce))?
                };
                self.share_done(batch, started, o)
            }
            ToAgent::ReclaimZero { batch, gfns } => {
                let o = self.punch_zero(gfns, Punch::IfZero)?;
                self.counters
                    .reclaim
                    .record_batch(started.elapsed(), o.done.len());
                ToDaemon::ReclaimDone {
                    batch,
                    reclaimed: o.done,
                    changed: o.changed,
                    refused: o.refused,
                }
            }
            ToAgent::Stash { batch, pages } => {
                let o = self.stash(pages)?;
                self.counters
                    .stash
                    .record_batch(started.elapsed(), o.done.len());
                ToDaemon::StashDone {
                    batch,
                    stashed: o.done,
                    changed: o.changed,
                    refused: o.refused,
                }
            }
            ToAgent::ClockScan {
                batch,
                first,
                count,
                arm,
                wp_only,
                zap_shared,
            } => {
                // Pages paged out and back in RAM since (reported with the events).
                let n = count
                    .min(CLOCK_SLICE)
                    .min(self.pages.len().saturating_sub(first.0));
                self.paged_in(first, n);
                let (count, referenced, modified) =
                    self.clock_scan(first, count, &arm, &wp_only)?;
                // Never fatal: the pages stay on their frames, protected, zapped or not,
                // and the slice's bits (already taken) must reach memfoldd.
                if zap_shared {
                    if let Err(e) = self.zap_shared(first, count) {
                        tracing::warn!("clock slice at {first}: {e}");
                    }
                }
                ToDaemon::ClockBits {
                    batch,
                    first,
                    count,
                    referenced,
                    modified,
                }
            }
            ToAgent::Watch { batch, gfns } => {
                let o = self.watch(gfns)?;
                ToDaemon::WatchDone {
                    batch,
                    watched: o.done,
                    refused: o.refused,
                }
            }
            ToAgent::DiscardFree { batch, gfns } => {
                let (private, held) = self.split_held(gfns);
                let mut o = self.punch_zero(private, Punch::IfWatched)?;
                self.discard_held(held, &mut o);
                self.counters
                    .reclaim
                    .record_batch(started.elapsed(), o.done.len());
                ToDaemon::DiscardDone {
                    batch,
                    discarded: o.done,
                    changed: o.changed,
                    refused: o.refused,
                }
            }
            ToAgent::PageOut { batch, gfns } => {
                let o = self.page_out(gfns);
                ToDaemon::PageOutDone {
                    batch,
                    paged: o.done,
                    resident: o.changed,
                    refused: o.refused,
                }
            }
            ToAgent::TakeBack { batch, gfns } => {
                let o = self.take_back(gfns);
                ToDaemon::TakeBackDone {
                    batch,
                    taken: o.done,
                    refused: o.refused,
                }
            }
            ToAgent::OptedOut { out } => {
                self.opted_out = out;
                return Ok(());
            }
            ToAgent::Welcome { .. } | ToAgent::Refused { .. } | ToAgent::LeavePool { .. } => {
                return Ok(())
            }
        };
        // The answer first: a no-copy break of a page of it, sent earlier, would be dropped
        // by memfoldd (not yet shared there) and the page then booked shared for good.
        self.send_to_memfoldd(reply);
        for ev in std::mem::take(&mut self.deferred) {
            self.handle_or_retry(ev);
        }
        Ok(())
    }

    /// The answer to a share or fill request `batch` begun at `started`, timed.
    fn share_done(&mut self, batch: BatchId, started: Instant, o: Outcome) -> ToDaemon {
        self.counters
            .share
            .record_batch(started.elapsed(), o.done.len());
        ToDaemon::ShareDone {
            batch,
            shared: o.done,
            changed: o.changed,
            refused: o.refused,
        }
    }

    /// Carries out a share request (ESX §4.3): maps the private pages whose bytes still
    /// equal their frame's onto it, a run of consecutive pages onto consecutive frames
    /// with one mapping.
    ///
    /// VMA headroom: a share of k pages adds at most 2k mappings itself (a run dropped into
    /// guest RAM splits it), and one more while it is staged. So only the first k pages of
    /// a request are shared such that the mappings now + 3k stay within seven eighths of
    /// the budget; the rest are refused. The last eighth is the CoW breaks' (a break
    /// cannot be refused): a break maps one page back (+2) while that fits, and past it
    /// breaks its whole run, which adds none (`vmas.rs`). Mappings are the whole
    /// process's, every region's: the limit (`vm.max_map_count`) is the process's.
    fn share(&mut self, pages: Vec<(Gfn, FrameId)>, expect: Expect) -> io::Result<Outcome> {
        let mut pages = pages;
        let mut out = Outcome::default();
        if self.pool.is_none() {
            out.refused.extend(pages.iter().map(|p| p.0));
            return Ok(out);
        }
        pages.sort_unstable();
        pages.dedup_by_key(|p| p.0);
        // Past the pool's end a frame reads as zeros and maps as a SIGBUS.
        let pool_frames = memfold_sys::memfd::size(self.pool()?)? / PAGE;
        pages.retain(|&(g, f)| {
            // A frame past what the page table packs is past any pool memfoldd makes.
            let ok = self.pages.is_private(g)
                && f.0 < crate::state::MAX_FRAME
                && u64::from(f.0) < pool_frames;
            if !ok {
                out.refused.push(g);
            }
            ok
        });
        // Checked and reserved against the whole process's mappings,
        // every region's (`vmas.rs`): breaks in any region count against one limit.
        let admitted =
            vmas::PROCESS.admit(self.vma_budget.get(), pages.len(), vmas::read_self_maps);
        if pages.len() > admitted.pages {
            out.refused
                .extend(pages.drain(admitted.pages..).map(|p| p.0));
        }
        // Runs of consecutive gfns onto consecutive frames: one mapping each.
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len()
                && pages[j].0 .0 == pages[j - 1].0 .0 + 1
                && pages[j].1 .0 == pages[j - 1].1 .0 + 1
            {
                j += 1;
            }
            self.share_run(&pages[i..j], &mut out, expect)?;
            i = j;
        }
        drop(admitted);
        Ok(out)
    }

    /// Shares one run of consecutive pages onto consecutive frames: write-protects the
    /// run, checks each page as `expect` says and maps each sub-run of pages that pass.
    fn share_run(
        &mut self,
        run: &[(Gfn, FrameId)],
        out: &mut Outcome,
        expect: Expect,
    ) -> io::Result<()> {
        let (g0, f0) = run[0];
        let n = run.len();
        let len = n as u64 * PAGE;
        let addr = self.page_addr(g0);
        self.uffd.write_protect(addr, len, true)?;
        // After the write-protection, before the read: pages a writer in another process
        // may still be copying into are left alone (the write fence).
        let held = held_by_writers(addr, n);
        let mut guest = vec![0u8; len as usize];
        let mut frames = vec![0u8; len as usize];
        pread_exact(self.memfd.as_fd(), &mut guest, g0.offset())?;
        pread_within(self.pool()?, &mut frames, f0.offset())?;
        let p = PAGE_SIZE;
        // Checked after the write-protection: a write from now on faults to this thread
        // and is served after the mapping change, as a CoW break of the frame.
        let equal: Vec<bool> = (0..n)
            .map(|k| {
                let page = &guest[k * p..(k + 1) * p];
                !held[k]
                    && match expect {
                        Expect::Frame => *page == frames[k * p..(k + 1) * p],
                        Expect::Nonce(nonce) => page[..NONCE] == nonce,
                    }
            })
            .collect();
        let mut k = 0;
        while k < n {
            let mut e = k + 1;
            while e < n && equal[e] == equal[k] {
                e += 1;
            }
            let (sub_addr, sub_len) = (addr + k as u64 * PAGE, (e - k) as u64 * PAGE);
            if equal[k]
                && self
                    .install(sub_addr, f0.offset() + k as u64 * PAGE, sub_len)
                    .is_err()
            {
                // Nothing was moved: the pages stay private.
                self.unprotect(sub_addr, sub_len)?;
                out.refused.extend(run[k..e].iter().map(|p| p.0));
            } else if equal[k] {
                // The pages are now read from the pool; failing to free the copies only
                // keeps their memory.
                self.punch(plus(g0, k), (e - k) as u64);
                for &(g, f) in &run[k..e] {
                    self.pages.set(g, PageHome::Frame(f));
                    out.done.push(g);
                }
            } else {
                self.unprotect(sub_addr, sub_len)?;
                out.changed.extend(run[k..e].iter().map(|p| p.0));
            }
            k = e;
        }
        Ok(())
    }

    /// Carries out a take-back request (the operator's opt-out): each page memfold holds
    /// becomes private again as the event it is — a shared page by a CoW break, a stored
    /// page decoded back, a reclaimed zero page a plain hole (zeros on the next touch).
    /// A page that cannot be taken back (a blob that does not decode, no VMA left) stays
    /// as it is, protected, and is refused; nothing here fails the agent.
    fn take_back(&mut self, mut gfns: Vec<Gfn>) -> Outcome {
        let mut out = Outcome::default();
        gfns.sort_unstable();
        gfns.dedup();
        for g in gfns {
            let taken = match self.pages.get(g) {
                None => Err(io::Error::other("past guest RAM")),
                Some(PageHome::Private) => Ok(()),
                Some(PageHome::Zero) => {
                    self.pages.set(g, PageHome::Private);
                    self.pending.refills.push(g);
                    Ok(())
                }
                Some(PageHome::Frame(f)) => self.cow_break(g, f),
                Some(PageHome::Stashed(s)) => self.unstash(g, &s, false),
            };
            match taken {
                Ok(()) => out.done.push(g),
                Err(e) => {
                    tracing::warn!("take-back of {g} refused: {e}");
                    out.refused.push(g);
                }
            }
        }
        out
    }

    /// Punches out of the guest memfd the private pages of `gfns` that still pass `test`
    /// and that no writer in another process holds, checked under write-protection
    /// (writers wait until the unprotect): each becomes a reclaimed zero page, refilled
    /// with zeros on its next access. Pages that fail are `changed`.
    ///
    /// - [`Punch::IfZero`]: a zero-page reclaim (ESX §4.3's zero page, without a frame):
    ///   the page's bytes are still all zero, so the refill gives back exactly them.
    /// - [`Punch::IfWatched`]: a free-page discard (issue 17; PV §3.1). memfoldd asks only
    ///   for pages the guest reported free in a report it asked for after the watch, so a
    ///   page whose watch bit is still set ([`crate::state::Pages::watch`]:
    ///   write-protected and unwritten since) was free at an instant after which nothing
    ///   wrote it: its bytes are no one's, and zeros do as well. That is the invariant
    ///   kept here.
    ///
    /// Errors: a userfaultfd call or the read of the pages failed.
    fn punch_zero(&mut self, gfns: Vec<Gfn>, test: Punch) -> io::Result<Outcome> {
        let mut out = Outcome::default();
        let gfns = self.private_only(gfns, &mut out);
        let p = PAGE_SIZE;
        for (g0, n) in runs(&gfns) {
            let (addr, len) = (self.page_addr(g0), n as u64 * PAGE);
            // Writers wait from here until the unprotect below.
            self.uffd.write_protect(addr, len, true)?;
            let held = held_by_writers(addr, n);
            let bytes = match test {
                Punch::IfZero => {
                    let mut b = vec![0u8; len as usize];
                    pread_exact(self.memfd.as_fd(), &mut b, g0.offset())?;
                    b
                }
                Punch::IfWatched => Vec::new(),
            };
            for (k, held) in held.into_iter().enumerate() {
                let g = plus(g0, k);
                let passes = match test {
                    Punch::IfZero => bytes[k * p..(k + 1) * p].iter().all(|&b| b == 0),
                    Punch::IfWatched => self.pages.watched(g),
                };
                if held || !passes {
                    out.changed.push(g);
                } else if self.punch(g, 1) {
                    self.pages.set(g, PageHome::Zero);
                    out.done.push(g);
                } else {
                    out.refused.push(g);
                }
            }
            self.unprotect(addr, len)?;
        }
        Ok(out)
    }

    /// Carries out a watch request (issue 17's free-page discard): write-protects the
    /// private pages and sets their watch bits, and those of pages on a pool frame or
    /// stashed (protected already). Refuses the others (zero pages: nothing to discard),
    /// and pages a writer in another process holds (the write fence): its write could
    /// land after the protection without a fault.
    ///
    /// Errors: write-protecting a run failed (bits set so far stay: those pages are
    /// protected).
    fn watch(&mut self, gfns: Vec<Gfn>) -> io::Result<Outcome> {
        let mut out = Outcome::default();
        let (gfns, held) = self.split_held(gfns);
        // A page on a frame or stashed is protected already: any write to it faults (a
        // CoW break, a decode) and gives it a new home, which ends the watch.
        for g in held {
            if held_by_writers(self.page_addr(g), 1)[0] {
                out.refused.push(g);
            } else {
                self.pages.watch(g);
                out.done.push(g);
            }
        }
        let gfns = self.private_only(gfns, &mut out);
        for (g0, n) in runs(&gfns) {
            let addr = self.page_addr(g0);
            self.uffd.write_protect(addr, n as u64 * PAGE, true)?;
            for (k, held) in held_by_writers(addr, n).into_iter().enumerate() {
                if held {
                    out.refused.push(plus(g0, k));
                } else {
                    self.pages.watch(plus(g0, k));
                    out.done.push(plus(g0, k));
                }
            }
        }
        Ok(out)
    }

    /// `gfns` split into pages on a pool frame or stashed (memfold holds them outside
    /// guest RAM) and the rest, each sorted and without repeats.
    fn split_held(&self, mut gfns: Vec<Gfn>) -> (Vec<Gfn>, Vec<Gfn>) {
        gfns.sort_unstable();
        gfns.dedup();
        gfns.into_iter().partition(|&g| {
            !matches!(
                self.pages.get(g),
                Some(PageHome::Frame(_) | PageHome::Stashed(_))
            )
        })
    }

    /// The free-page discard of pages memfold holds outside guest RAM (Satori §4.3's
    /// no-copy-on-write, per page; issue 17): a page on a pool frame or stashed whose
    /// watch bit is still set was free at an instant after which nothing wrote it — a
    /// write would have broken its share or decoded it, giving it a new home and ending
    /// the watch — so it becomes a reclaimed zero page: the frame's mapping gives way to
    /// guest RAM's hole (the frame loses this holder), the blob is let go. Its next
    /// access reads zeros and no copy is made. The invariant is the private discard's
    /// ([`Agent::punch_zero`]): *discarded only if unwritten since its watch*. A page a
    /// writer in another process holds, or whose mapping back would take QEMU past its
    /// VMA budget, stays as it is (changed, refused).
    fn discard_held(&mut self, gfns: Vec<Gfn>, out: &mut Outcome) {
        for g in gfns {
            if !self.pages.watched(g) || held_by_writers(self.page_addr(g), 1)[0] {
                out.changed.push(g);
                continue;
            }
            if let PageHome::Frame(_) = self.pages.home(g) {
                let fits = crate::vmas::PROCESS
                    .break_fits(self.vma_budget.get(), crate::vmas::read_self_maps);
                // A hole already (punched at the share); punched again in case something
                // wrote the memfd outside QEMU's mapping, so the page reads zeros.
                self.punch(g, 1);
                if !fits || self.map_guest_page(g).is_err() {
                    out.refused.push(g);
                    continue;
                }
            } else {
                self.punch(g, 1);
            }
            self.pages.set(g, PageHome::Zero);
            out.done.push(g);
        }
    }

    /// `gfns` sorted, without repeats, and private; the others refused in `out`.
    pub(crate) fn private_only(&self, mut gfns: Vec<Gfn>, out: &mut Outcome) -> Vec<Gfn> {
        gfns.sort_unstable();
        gfns.dedup();
        gfns.retain(|&g| {
            let ok = self.pages.is_private(g);
            if !ok {
                out.refused.push(g);
            }
            ok
        });
        gfns
    }

    /// Carries out a stash request (DE §3.2–3.3, §4.6): punches out of the guest memfd
    /// each private page whose blob decodes to its bytes; moves the blobs of pages marked
    /// `moving`.
    fn stash(&mut self, mut pages: Vec<StashPage>) -> io::Result<Outcome> {
        let mut out = Outcome::default();
        pages.sort_unstable_by_key(|p| p.gfn);
        pages.dedup_by_key(|p| p.gfn);
        let mut decoded: Page = [0; PAGE_SIZE];
        let mut now: Page = [0; PAGE_SIZE];
        for p in pages {
            let g = p.gfn;
            if p.moving {
                match self.move_stashed(&p, &mut decoded, &mut now) {
                    Ok(true) => out.done.push(g),
                    Ok(false) => out.changed.push(g),
                    Err(e) => {
                        tracing::warn!("move refused: {e}");
                        out.refused.push(g);
                    }
                }
                continue;
            }
            if !self.pages.is_private(g) {
                out.refused.push(g);
                continue;
            }
            // With the request's checksum: an identical patch too is decoded and checked
            // here (and compared below), which its later decode, kept without a checksum,
            // relies on (`fault.rs`, `decode_identical`).
            let stash = Stash::from(&p);
            if let Err(e) = self.decode_stashed(g, &stash, &mut decoded) {
                tracing::warn!("stash refused: {e}");
                out.refused.push(g);
                continue;
            }
            let addr = self.page_addr(g);
            // Writers wait from here until the unprotect below.
            self.uffd.write_protect(addr, PAGE, true)?;
            let held = held_by_writers(addr, 1)[0];
            pread_exact(self.memfd.as_fd(), &mut now, g.offset())?;
            if held || now != decoded {
                out.changed.push(g);
            } else {
                // Writers wait, and the blob decodes to exactly its bytes, which the next
                // access gets back.
                if self.punch(g, 1) {
                    self.pages.set(g, PageHome::Stashed(stash));
                    out.done.push(g);
                } else {
                    out.refused.push(g);
                }
            }
            self.unprotect(addr, PAGE)?;
        }
        Ok(out)
    }

    /// Moves stashed page `p.gfn` to the blob `p` names (in the swap file) if the page is
    /// still stashed in the store and both blobs decode to the same bytes. Returns whether
    /// it moved (not: the guest touched the page since, or the bytes differ). The page is
    /// not in guest RAM, and faults on it are served by this thread: nothing can change it
    /// meanwhile. A page kept as the identical patch moves as any other: its frame's bytes
    /// against the new blob, decoded and checked with the request's checksum; it then
    /// takes a record.
    ///
    /// Errors: a blob cannot be read or decoded.
    fn move_stashed(&mut self, p: &StashPage, new: &mut Page, old: &mut Page) -> io::Result<bool> {
        let cur = match self.pages.get(p.gfn) {
            Some(PageHome::Stashed(cur)) if cur.home == BlobHome::Store => cur,
            _ => return Ok(false),
        };
        let to = Stash::from(p);
        self.decode_stashed(p.gfn, &cur, old)?;
        self.decode_stashed(p.gfn, &to, new)?;
        if old != new {
            return Ok(false);
        }
        self.pages.set(p.gfn, PageHome::Stashed(to));
        Ok(true)
    }

    /// Reports and clears the R and M bits of `[first, first+count)` (clamped to RAM and
    /// [`CLOCK_SLICE`]) and arms again the slice's private pages that `arm` names (DE
    /// §4.2; bit k of word k/64 for gfn `first + k`). Returns (pages, R bits, M bits),
    /// same layout.
    ///
    /// Errors: write-protecting or zapping a run failed.
    fn clock_scan(
        &mut self,
        first: Gfn,
        count: u32,
        arm: &[u64],
        wp_only: &[u64],
    ) -> io::Result<(u32, Vec<u64>, Vec<u64>)> {
        let npages = self.pages.len();
        let n = count.min(CLOCK_SLICE).min(npages.saturating_sub(first.0));
        self.read_rbits(first, n);
        let (r, m) = self.pages.take_bits(first, n);
        // Arm runs of private pages memfoldd names; shared and reclaimed pages fault
        // anyway, and a page left unarmed is only watched less (no data depends on it).
        // Bit k of word k/64 of a mask (missing words: none).
        let bit = |mask: &[u64], k: u32| {
            mask.get(k as usize / 64)
                .is_some_and(|w| w >> (k % 64) & 1 == 1)
        };
        let named = |k: u32| bit(arm, k);
        let private = |agent: &Agent, k: u32| {
            named(k) && agent.pages.home(plus(first, k as usize)) == PageHome::Private
        };
        // Pages memfoldd takes R for from the guest's LRU: write-protected, not zapped.
        let wp_only = |k: u32| bit(wp_only, k);
        // What the page tables showed when the R bits were read (the `pagemap` mode).
        let mapped = self.mapped_at_scan.as_ref().filter(|m| m.covers(first, n));
        // Runs armed: every page of them zapped, or unmapped already (the same state).
        let mut armed = Vec::new();
        let mut skipped = 0;
        let mut runs = Vec::new();
        let mut k = 0;
        while k < n {
            if !private(self, k) {
                k += 1;
                continue;
            }
            let mut e = k + 1;
            while e < n && private(self, e) {
                e += 1;
            }
            let (addr, len) = (
                self.page_addr(plus(first, k as usize)),
                (e - k) as u64 * PAGE,
            );
            self.uffd.write_protect(addr, len, true)?;
            // The zap's runs: the protected run less its write-only pages.
            let mut z = k;
            while z < e {
                if wp_only(z) {
                    z += 1;
                    continue;
                }
                let mut ze = z + 1;
                while ze < e && !wp_only(ze) {
                    ze += 1;
                }
                armed.push((plus(first, z as usize), (ze - z) as u64));
                // Only from the first page mapped to the last: a cold page, zapped at
                // the last pass and untouched since, has no PTE to drop (and a run of
                // them no zap at all).
                match mapped.map_or(Some((z, ze)), |m| m.span(z, ze)) {
                    Some((lo, hi)) => runs.push((
                        self.page_addr(plus(first, lo as usize)),
                        (hi - lo) as u64 * PAGE,
                    )),
                    None => skipped += 1,
                }
                z = ze;
            }
            k = e;
        }
        self.counters.clock_zaps_skipped += skipped;
        // On the helper thread: the caller of MADV_DONTNEED waits for its remove event.
        if !runs.is_empty() {
            self.counters.clock_zaps += runs.len() as u64;
            let errno = self.helper(Job::Zap(runs));
            if errno != 0 {
                return Err(io::Error::other(format!(
                    "arming the clock: madvise: {}",
                    io::Error::from_raw_os_error(errno)
                )));
            }
        }
        // The pagemap clock reads these pages' presence at the next scan.
        if self.rbits.is_some() {
            for (g, k) in armed {
                self.pages.zapped(g, k);
            }
        }
        Ok((n, r, m))
    }
}

/// Runs of consecutive pages in sorted `gfns`, as (first page, pages).
pub(crate) fn runs(gfns: &[Gfn]) -> Vec<(Gfn, usize)> {
    let mut out: Vec<(Gfn, usize)> = Vec::new();
    for &g in gfns {
        match out.last_mut() {
            Some((g0, n)) if g0.0 + *n as u32 == g.0 => *n += 1,
            _ => out.push((g, 1)),
        }
    }
    out
}

/// Which of the `n` pages from `addr` (just write-protected, not yet read) a writer in
/// another process may still be copying into (`memfold_sys::fence`): such a page was
/// pinned before the write-protection and takes the copy without a fault, so it must not
/// be mapped over or punched out. `run` does not start without the fence.
fn held_by_writers(addr: u64, n: usize) -> Vec<bool> {
    let fence = crate::fence::write_fence();
    // The write-protection's page-table locks order it before these loads today; say so.
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    (0..n)
        .map(|k| fence.is_none_or(|f| f.busy(addr + k as u64 * PAGE)))
        .collect()
}
