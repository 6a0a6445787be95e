//! No-copy-on-write for a device's whole-page writes (Satori §4.3: "informs the VMM
//! that a page is being reallocated, and instead allocates a zero page ... for the
//! private version"). A block device that reads the disk into guest pages overwrites
//! them whole; when they are on pool frames (page cache the guest dropped and reuses, or
//! a buffer the scan shared while it sat idle), each page's CoW break used to copy a
//! frame that was about to be overwritten, and cost the device one round trip through
//! this thread per page. The device declares its call's whole pages in the write fence
//! (`memfold_sys::fence`, `WriteFence::hold_writing`); the first of them that faults
//! breaks them all, each onto a zeroed private page, in one go.
//!
//! The invariant, kept by [`Agent::declared_whole`] and [`Agent::break_declared`]: **a
//! page on a frame is broken without a copy only if the thread whose write faulted on
//! it — a thread of another process, so not QEMU's — declared that the call it is
//! blocked in overwrites that page whole**, and only the pages of that declaration still
//! on frames are broken with it. Such a page has not been written by the call yet (a
//! write to a page on a frame faults), the fence keeps pages under a held chunk from
//! being shared again during the call, and the call overwrites them next. If the call
//! fails midway (QEMU unmapped part of RAM, the device was killed) its pages not yet
//! written read zeros: the device reports the request failed, and a buffer the guest
//! handed a device to fill holds no byte of any other guest or of any other time.
//! A QEMU that forges declarations (a guest escaped into it) can zero pages of its own
//! guest, never another's: its agent serves only its own guest RAM. Broken on purpose in
//! `tests/nocopy.rs`.

use std::io;

use memfold_ids::{FrameId, Gfn};
use memfold_sys::proc::monotonic_ns;

use crate::state::{plus, PageHome};
use crate::{Agent, PAGE};

impl Agent {
    /// The runs (first page's address, pages) the writer thread `tid` declared its call
    /// under way overwrites whole, if that call covers `page`; `None` for a fault of one
    /// of this process's threads (QEMU's, whose declarations prove nothing: it may have
    /// made them itself), without a fence, or with no fresh declaration covering it.
    pub(crate) fn declared_whole(&self, tid: u32, page: u64) -> Option<Vec<(u64, u64)>> {
        if tid == 0 {
            return None;
        }
        // The records first: most faults (vCPUs') match none, and cost no system call.
        let runs = crate::fence::write_fence()?.declared_whole(tid, page, monotonic_ns())?;
        (!own_thread(tid)).then_some(runs)
    }

    /// The CoW break of page `gfn` (on `frame`) under a write declared whole, `runs`
    /// ([`Agent::declared_whole`]): every page of the runs in this region still on a frame
    /// is broken without a copy, onto a zeroed private page installed writable, each
    /// reported as a break and counted in `nocopy_breaks`. Pages the VMA budget has no
    /// room for stay on their frames (their own fault breaks them); if that leaves `gfn`,
    /// it is broken with a copy as usual.
    ///
    /// Errors: those of [`Agent::cow_break`], when `gfn` falls back to it.
    pub(crate) fn break_declared(
        &mut self,
        gfn: Gfn,
        frame: FrameId,
        runs: &[(u64, u64)],
    ) -> io::Result<()> {
        let mut on_frames: Vec<(Gfn, FrameId)> = Vec::new();
        for &(addr, pages) in runs {
            let from = addr.max(self.base);
            let to = addr
                .saturating_add(pages * PAGE)
                .min(self.base + self.ram_bytes);
            let mut a = from;
            while a < to {
                let g = Gfn(((a - self.base) / PAGE) as u32);
                if let Some(PageHome::Frame(f)) = self.pages.get(g) {
                    on_frames.push((g, f));
                }
                a += PAGE;
            }
        }
        on_frames.sort_unstable();
        on_frames.dedup_by_key(|p| p.0);
        let gfns: Vec<Gfn> = on_frames.iter().map(|p| p.0).collect();
        let mut broke_it = false;
        let mut at = 0;
        for (_, n) in crate::requests::runs(&gfns) {
            let group = &on_frames[at..at + n];
            at += n;
            let has = group.iter().any(|&(g, _)| g == gfn);
            match self.break_group_nocopy(group) {
                Ok(()) => broke_it |= has,
                Err(e) => tracing::debug!(
                    "no-copy break of {} pages from {}: {e}",
                    group.len(),
                    group[0].0
                ),
            }
        }
        if !broke_it {
            return self.cow_break(gfn, frame);
        }
        // memfoldd hears of the breaks before the device's report of the pages landed,
        // which follows the wake within microseconds: a landing on a page memfoldd still
        // holds as shared is passed over (no share at read). Unless memfoldd is behind
        // reading (the breaks then wait): a share at read missed, nothing else.
        self.send_breaks();
        // The one wake: the writer goes on only once every group is in place, or it would
        // overtake the groups still being broken and fault on them one by one.
        Ok(self.uffd.wake(self.page_addr(gfn), PAGE)?)
    }

    /// Breaks `group` (pages on frames, consecutive gfns) without copying: the guest
    /// memfd's pages punched (holes since their share; punched again so that nothing of
    /// theirs shows), guest RAM mapped back over them, and zeroed pages installed writable
    /// (`UFFDIO_ZEROPAGE`; where it fails, the writer's retry takes a missing fault and is
    /// zero-filled as any hole). Each is marked R and M, which clears its watch bit.
    ///
    /// Errors: the VMA budget has no room, the punch or the mapping failed (nothing
    /// changed: every page still on its frame).
    fn break_group_nocopy(&mut self, group: &[(Gfn, FrameId)]) -> io::Result<()> {
        let (first, n) = (group[0].0, group.len());
        if !crate::vmas::PROCESS.break_fits(self.vma_budget.get(), crate::vmas::read_self_maps) {
            return Err(io::Error::other("the VMA budget has no room"));
        }
        if !self.punch(first, n as u64) {
            return Err(io::Error::other("punching the guest memfd failed"));
        }
        self.map_guest_range(first, n)?;
        self.broken(group.iter().copied());
        for k in 0..n {
            self.pages.mark(plus(first, k), true);
        }
        self.counters.nocopy_breaks += n as u64;
        if let Err(e) = self
            .uffd
            .zeropage_dontwake(self.page_addr(first), n as u64 * PAGE)
        {
            tracing::debug!("zero pages for {n} pages from {first}: {e}");
        }
        Ok(())
    }
}

/// Whether `tid` is a thread of this process (QEMU's), or cannot be told apart from one:
/// `tgkill` with no signal finds it in this thread group. Only `ESRCH` says it is not.
fn own_thread(tid: u32) -> bool {
    // SAFETY: signal 0 sends nothing; the call only looks the thread up.
    let rc = unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), tid as libc::pid_t, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}
