//! Ranges of guest RAM that QEMU discarded (`UFFD_EVENT_REMOVE`): a balloon inflating,
//! free page reporting, virtio-mem unplugging. QEMU's `ram_block_discard_range` punches
//! the range out of guest RAM's memfd, then drops its mapping with `MADV_DONTNEED`; the
//! kernel reports the second to us, and the caller waits until the event is read.
//!
//! memfold lets go of what it held there, as KSM unmerges a range dropped with
//! `MADV_DONTNEED` (its selftests' "unmerge discarded"), and the pages read as zeros, as
//! they would without memfold:
//!
//! | page was | now |
//! |---|---|
//! | private | nothing to do: QEMU's punch made it a hole (one paged out to the kernel's swap, and a hole now, is reported as no longer there, `ToDaemon::PagedIn`) |
//! | on a pool frame | guest RAM's memfd (a hole) mapped back over it and registered |
//! | a reclaimed zero page | a plain hole |
//! | stashed | a plain hole; its blob is memfoldd's to release |
//!
//! Each non-private page is reported to memfoldd with what it was
//! (`ToDaemon::Discarded`), which releases the frame's reference or the blob.
//!
//! Why it is safe to treat the event as a discard: it is read only after the punch (QEMU
//! punches first), so whenever it is handled, even after a share or stash that compared
//! the page's bytes in between, the bytes the guest may expect are the hole's zeros. So
//! an event read in the middle of a request is handled after it (`deferred`, in order
//! with faults): a page being shared is on its frame by then, and is let go. The
//! `MADV_DONTNEED`s without a punch are the agent's own. Arming the clock, over private
//! pages only: its events are handled right after the clock request, before any other
//! request can change a page's home, so they find private pages only and change
//! nothing (a paged-out page among them is still data in the memfd, its swap entry, and
//! stays paged out). Dropping the PTEs of pages on frames (`Agent::zap_shared`): those
//! events would let the frames go, so they are recognised by their range while the zap
//! runs and dropped (`install.rs`, `Job::ZapFrames`); a discard by QEMU of the same
//! range at that very moment is dropped with them, and the pages stay on their frames
//! (their guest freed them; memfoldd's books and the agent's agree). A page QEMU
//! punched that the guest touches again before the event is handled is data once more,
//! so it is not reported here; the residency check before the next clock scan of its
//! slice reports it (`pageout.rs`).
//!
//! What memfold assumes: every other `MADV_DONTNEED`/`MADV_REMOVE` of guest RAM discards
//! it, as QEMU's does (for memfd-backed RAM it always punches first). A process that drops
//! PTEs of guest RAM expecting the memfd to keep the bytes would read zeros on the pages
//! memfold held (its own bytes on private ones). QEMU has no such caller; its guest cannot
//! make one (tests/bypass_writes.rs, tests/discard.rs).

use std::os::fd::AsFd;

use std::sync::atomic::{AtomicU64, Ordering};

use memfold_ids::{FrameId, Gfn};
use memfold_wire::Discarded;

use crate::state::PageHome;
use crate::{Agent, PAGE};

/// Pages discards left on their frames for want of VMA room, this process's (cumulative).
static KEPT_ON_FRAMES: AtomicU64 = AtomicU64::new(0);

impl Agent {
    /// QEMU discarded `[start, end)` of this process's memory (bytes); the part in guest RAM
    /// is handled as the table above says. A page on a pool frame whose mapping cannot be
    /// replaced (the VMA budget has no room for it, `vmas.rs`, or the kernel refuses)
    /// stays on its frame, as it was: the guest still reads its own bytes, and nothing is
    /// reported.
    pub(crate) fn discard(&mut self, start: u64, end: u64) {
        let ram_end = self.base + self.ram_bytes;
        let (start, end) = (start.max(self.base), end.min(ram_end));
        if start >= end {
            return;
        }
        let first = (start - self.base) / PAGE;
        let last = (end - self.base).div_ceil(PAGE);
        // Where the memfd still holds data (a swapped-out page is data to `SEEK_DATA`),
        // asked only if a page here is paged out; sorted runs, searched by halves. A seek
        // that fails ends the runs there: the pages after count as punched and are
        // reported back, which costs at most a read that swaps them in.
        let data = self
            .pages
            .any_paged_out(Gfn(first as u32), (last - first) as u32)
            .then(|| {
                memfold_sys::memfd::data_runs(
                    self.memfd.as_fd(),
                    Gfn(first as u32),
                    Gfn(last as u32),
                )
            });
        let mut kept_on_frames = 0;
        for g in first..last {
            let gfn = Gfn(g as u32);
            let what = match self.pages.home(gfn) {
                PageHome::Private => {
                    // Punched (QEMU's discard), the kernel holds it no more: the punch
                    // freed its swap entry. Still data, the event was the agent's own
                    // arming zap and the page is still in swap: nothing to say. (Before
                    // this check each clock pass reported every paged-out page back, and
                    // memfoldd's scans then read them all back in.)
                    let punched = || {
                        !data.as_ref().is_some_and(|runs| {
                            let k = runs.partition_point(|&(_, b)| b <= gfn);
                            runs.get(k).is_some_and(|&(a, _)| a <= gfn)
                        })
                    };
                    if self.pages.is_paged_out(gfn) && punched() {
                        self.pages.paged_in(gfn);
                        self.pending.paged_in.push(gfn);
                    }
                    continue;
                }
                PageHome::Zero => Discarded::Zero,
                PageHome::Stashed(_) => Discarded::Stashed,
                PageHome::Frame(f) => {
                    // Guest RAM mapped back over a page inside a run adds two mappings:
                    // only within the VMA budget, as a CoW break's (past it QEMU's own
                    // mmaps would fail); else it stays on its frame, as when the kernel
                    // refuses. At a run's edge it adds one at most (the budget's
                    // headroom covers it), alone it takes two away: always done.
                    let on = |g: Option<u32>, f: Option<u32>| {
                        g.zip(f).is_some_and(|(g, f)| {
                            self.pages.get(Gfn(g)) == Some(PageHome::Frame(FrameId(f)))
                        })
                    };
                    let inside = on(gfn.0.checked_sub(1), f.0.checked_sub(1))
                        && on(gfn.0.checked_add(1), f.0.checked_add(1));
                    if inside
                        && !crate::vmas::PROCESS
                            .break_fits(self.vma_budget.get(), crate::vmas::read_self_maps)
                    {
                        kept_on_frames += 1;
                        continue;
                    }
                    Discarded::Frame(f)
                }
            };
            // A hole already, unless written outside QEMU's mapping (a vhost-user
            // backend): discarded either way, so that the page reads as zeros.
            self.punch(gfn, 1);
            if let Discarded::Frame(_) = what {
                if let Err(e) = self.map_guest_page(gfn) {
                    tracing::warn!("discard of {gfn} left it on its frame: {e}");
                    continue;
                }
            }
            self.pages.set(gfn, PageHome::Private);
            self.pending.discards.push((gfn, what));
        }
        if kept_on_frames > 0 {
            // A balloon discards a page an event: said at the 1st, 2nd, 4th... page.
            let before = KEPT_ON_FRAMES.fetch_add(kept_on_frames, Ordering::Relaxed);
            let now = before + kept_on_frames;
            if (before + 1..=now).any(u64::is_power_of_two) {
                tracing::warn!(
                    "discards left {now} pages on their frames so far: the VMA budget had no room to map guest RAM back over them"
                );
            }
        }
    }
}
