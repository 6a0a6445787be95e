//! The write fence between writers of guest RAM in other processes and the agent.
//!
//! A block device in its own process writes guest RAM through QEMU's page tables
//! (`process_vm_writev`). The kernel pins the target pages first and copies into them
//! after; a page write-protected between the pin and the copy takes the copy without a
//! fault. The agent compares a page under write-protection and then maps a frame over it
//! (a share), or punches it out (a zero page, a stashed page): a copy still to come lands
//! in a page the guest no longer sees, and the guest reads the old bytes. The kernel's
//! KSM refuses such pages by their reference count (`write_protect_page`: "no O_DIRECT
//! or similar I/O is in progress"); userspace cannot see references, so the writers say
//! so themselves, here.
//!
//! The fence is one memfd per QEMU process, named [`FENCE_NAME`], that the agent creates
//! in its constructor (before QEMU's `main`, so before any device can connect) and a
//! device finds among QEMU's descriptors ([`WriteFence::of_process`]). It holds a
//! counter per [`CHUNK`] of QEMU's address space (hashed into [`SLOTS`] slots; two chunks
//! sharing a slot only make the agent more careful). The protocol, a Dekker handshake
//! whose barriers are the system calls and the locked increments:
//! - a writer [`WriteFence::hold`]s the chunks of its target before its copy's system
//!   call and lets go when it has returned (the copy is done);
//! - the agent write-protects a page, then asks [`WriteFence::busy`]; if the page's chunk
//!   is held it leaves the page alone (as a page that changed), else it reads the page.
//!
//! Why nothing is lost: if the agent sees the chunk free, each writer either let go
//! before (its copy is in the page the agent then reads) or holds it after the agent's
//! write-protection, so pins the page after it and faults, waiting for the agent like a
//! vCPU store. A QEMU that writes the fence (a guest escaped into it) only makes its own
//! agent share less, or lose its own guest's writes; the device checks the memfd is
//! sealed against shrinking, so no access to it can fault.
//!
//! **Whole-page declarations** (Satori §4.3's no-copy-on-write, for a device's writes): a
//! writer that overwrites whole pages says so for the length of its call
//! ([`WriteFence::hold_writing`]: a record of its thread id, the time and the pages, in
//! a seqlock, made before the call and withdrawn after it returns). A page on a pool
//! frame that such a write faults on needs no copy of the frame: its old bytes are about
//! to be overwritten, so the agent maps a zeroed private page in their place, and breaks
//! every other page of the declaration still on a frame with it — one round trip for
//! the whole call instead of one per page. The agent trusts a declaration only for a
//! fault of the thread that made it ([`WriteFence::declared_whole`]), which is then
//! blocked inside the very call the declaration covers; a QEMU that forges records can
//! only make its own guest read zeros (its agent serves only its own guest RAM).
//!
//! A writer whose copy lands after its call returns (QEMU's `aio=native`: the kernel
//! completes the read later, and QEMU reaps it from a ring in its own memory, with no
//! call to hold the fence across) [`WriteFence::close`]s the fence instead, before its
//! first such call: from then on every page is busy, so the agent takes no page again.
//! What it already holds stays safe, since a pin of a page it holds faults.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

/// The memfd's name (`/proc/PID/fd` shows `/memfd:memfold-fence (deleted)`).
pub const FENCE_NAME: &str = "memfold-fence";

/// Bytes of QEMU's address space one counter covers: 64 KiB (16 pages).
pub const CHUNK: u64 = 1 << 16;

/// Counters (4 bytes each, after a 4 KiB header): 256 KiB of memfd, of which only the
/// slots used are ever allocated (so too of the [`RECORDS`] declarations after them).
pub const SLOTS: usize = 1 << 16;

/// Whole-page declarations the fence holds at once: one per writer thread inside a call
/// (a writer that finds none free declares nothing, and the agent copies as before).
pub const RECORDS: usize = 64;

/// Runs of pages one declaration lists at most (its first ones; pages of later runs are
/// copied as before).
pub const RECORD_RUNS: usize = 508;

/// Pages one declared run covers at most (its length is packed in a page address's 12
/// low bits).
pub const RUN_PAGES: u64 = 4096;

/// How long a declaration is trusted after it was made: a writer killed inside its call
/// leaves its record behind, and its thread id may name another thread one day. A call
/// that takes longer gets its pages copied, as before.
pub const DECLARATION_FRESH_NS: u64 = 10_000_000_000;

/// The header: the magic at 0, the closed flag at [`CLOSED_AT`].
const HEADER: usize = 4096;
const CLOSED_AT: usize = 8;
/// Bytes one read or write system call transfers at most (Linux's `MAX_RW_COUNT`).
const MAX_TRANSFER: u64 = 0x7fff_f000;
/// One declaration: seq (4 bytes), owner (4), runs (4), pad (4), stamp (8), then
/// [`RECORD_RUNS`] runs of 8 bytes: 4 KiB.
const RECORD: usize = 4096;
const RECORDS_AT: usize = HEADER + SLOTS * 4;
const LEN: usize = RECORDS_AT + RECORDS * RECORD;
const MAGIC: u64 = u64::from_le_bytes(*b"MFFENCE2");
/// The first fence (no declarations), which agents built before them make: a device
/// takes it, holds it and declares nothing (a running QEMU keeps its agent until it
/// restarts).
const LEN_V1: usize = RECORDS_AT;
const MAGIC_V1: u64 = u64::from_le_bytes(*b"MFFENCE1");
const PAGE: u64 = 4096;

/// One process's write fence, mapped shared (see the module).
#[derive(Debug)]
pub struct WriteFence {
    base: NonNull<u8>,
    _fd: OwnedFd,
    /// Bytes mapped: [`LEN`], or [`LEN_V1`] for a first fence.
    len: usize,
}

// SAFETY: the mapping is only accessed through atomics; it lives as long as the value.
unsafe impl Send for WriteFence {}
// SAFETY: as above.
unsafe impl Sync for WriteFence {}

impl Drop for WriteFence {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, `len` bytes; no reference into it outlives
        // self (holds borrow self).
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// Chunks held by one writer for one copy, and its whole-page declaration if it made
/// one; let go (the declaration withdrawn first) when dropped.
#[derive(Debug)]
pub struct FenceHold<'f> {
    fence: &'f WriteFence,
    slots: Vec<u32>,
    record: Option<usize>,
}

impl Drop for FenceHold<'_> {
    fn drop(&mut self) {
        if let Some(r) = self.record {
            self.fence.withdraw(r);
        }
        for &s in &self.slots {
            // After the copy's system call returned: its bytes are in the page.
            self.fence.slot(s as usize).fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl WriteFence {
    /// The agent's fence: a new sealed memfd (see the module).
    ///
    /// Errors: creating, sizing, mapping or sealing the memfd failed.
    pub fn create() -> io::Result<WriteFence> {
        let fd =
            rustix::fs::memfd_create(FENCE_NAME, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, LEN as u64)?;
        let f = Self::map(fd, LEN)?;
        f.magic().store(MAGIC, Ordering::SeqCst);
        rustix::fs::fcntl_add_seals(
            &f._fd,
            SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL,
        )?;
        Ok(f)
    }

    /// The fence of process `pid`, held by `pidfd` (a QEMU whose agent made one), found
    /// among its descriptors; `None` if it has none (no agent: nothing there is shared,
    /// stashed or reclaimed, so no write needs a fence). Needs the access
    /// `process_vm_writev` needs.
    ///
    /// The descriptor is taken with `pidfd_getfd`, never reopened by its `/proc` link:
    /// what is checked is what is mapped, and a QEMU that swaps the descriptor for a FIFO
    /// or a FUSE file between a look and an `open` cannot make the device block.
    ///
    /// Errors: `/proc/PID/fd` cannot be read, a descriptor named as the fence cannot be
    /// taken, or none named so is one (not sealed against shrinking, the wrong size, no
    /// magic).
    pub fn of_process(pidfd: BorrowedFd<'_>, pid: u32) -> io::Result<Option<WriteFence>> {
        let dir = format!("/proc/{pid}/fd");
        let want = format!("/memfd:{FENCE_NAME}");
        let mut refused = None;
        for e in std::fs::read_dir(&dir)? {
            let path = e?.path();
            let Ok(target) = std::fs::read_link(&path) else {
                continue;
            };
            if !target.to_string_lossy().starts_with(&want) {
                continue;
            }
            let Some(n) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.parse::<i32>().ok())
            else {
                continue;
            };
            let got =
                rustix::process::pidfd_getfd(pidfd, n, rustix::process::PidfdGetfdFlags::empty())
                    .map_err(io::Error::from)
                    .and_then(|fd| Self::checked(fd, &path.display().to_string()));
            match got {
                Ok(f) => return Ok(Some(f)),
                Err(e) => refused = refused.or(Some(e)),
            }
        }
        refused.map_or(Ok(None), Err)
    }

    /// `fd` (named `what` in errors) as a fence, checked: sealed against shrinking (asked
    /// first: only shmem files have seals, and asking makes no round trip to any file
    /// system), the right size, the magic.
    fn checked(fd: OwnedFd, what: &str) -> io::Result<WriteFence> {
        let bad = |why: &str| io::Error::other(format!("{what}: {why}: not memfold's write fence"));
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|_| bad("no seals"))?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(bad("not sealed against shrinking"));
        }
        let (len, magic) = match rustix::fs::fstat(&fd)?.st_size as usize {
            LEN => (LEN, MAGIC),
            LEN_V1 => (LEN_V1, MAGIC_V1),
            _ => return Err(bad("wrong size")),
        };
        let f = Self::map(fd, len)?;
        if f.magic().load(Ordering::SeqCst) != magic {
            return Err(bad("no magic"));
        }
        Ok(f)
    }

    /// Whether this fence carries whole-page declarations (not a first fence, made by an
    /// agent built before them).
    pub fn declares(&self) -> bool {
        self.len == LEN
    }

    fn map(fd: OwnedFd, len: usize) -> io::Result<WriteFence> {
        // SAFETY: a new shared mapping of `len` bytes of a memfd at least that long (sized
        // or checked by the callers), at an address the kernel picks.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd.as_fd(),
                0,
            )?
        };
        Ok(WriteFence {
            base: NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap gave null"))?,
            _fd: fd,
            len,
        })
    }

    fn magic(&self) -> &AtomicU64 {
        // SAFETY: the header's first 8 bytes, aligned (page-aligned mapping), inside it.
        unsafe { &*self.base.as_ptr().cast::<AtomicU64>() }
    }

    fn closed(&self) -> &AtomicU32 {
        // SAFETY: 4 aligned bytes of the header, inside the mapping.
        unsafe { &*self.base.as_ptr().add(CLOSED_AT).cast::<AtomicU32>() }
    }

    fn slot(&self, s: usize) -> &AtomicU32 {
        debug_assert!(s < SLOTS);
        // SAFETY: slot s < SLOTS is 4-byte aligned inside the mapping after the header.
        unsafe { &*self.base.as_ptr().add(HEADER + 4 * s).cast::<AtomicU32>() }
    }

    /// The slot of chunk `chunk` (address / [`CHUNK`]).
    fn slot_of(chunk: u64) -> usize {
        (chunk.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 48) as usize % SLOTS
    }

    /// Holds every chunk of each `(address, length)` range until the hold is dropped: call
    /// before the system call that writes them, drop after it returned.
    pub fn hold(&self, ranges: impl IntoIterator<Item = (u64, u64)>) -> FenceHold<'_> {
        let mut slots = Vec::new();
        for (va, len) in ranges {
            if len == 0 {
                continue;
            }
            // No call transfers more (the kernel's MAX_RW_COUNT); a bogus length from a
            // caller holds at most this much and never overflows.
            let len = len.min(MAX_TRANSFER);
            let (first, last) = (va / CHUNK, va.saturating_add(len - 1) / CHUNK);
            for c in first..=last {
                let s = Self::slot_of(c);
                self.slot(s).fetch_add(1, Ordering::SeqCst);
                slots.push(s as u32);
            }
        }
        FenceHold {
            fence: self,
            slots,
            record: None,
        }
    }

    /// [`WriteFence::hold`], and a declaration by the calling thread that its call
    /// overwrites every whole page of `ranges` (the 4 KiB-aligned pages each range covers
    /// entirely; partial pages are only held). Call right before the system calls that
    /// write them all, every byte of every range (or fail), and drop after the last
    /// returned: the declaration covers those calls only. Declares nothing if no page is
    /// whole or no record is free.
    pub fn hold_writing(&self, ranges: &[(u64, u64)]) -> FenceHold<'_> {
        let mut hold = self.hold(ranges.iter().copied());
        let runs: Vec<u64> = ranges
            .iter()
            .flat_map(|&(va, len)| whole_runs(va, len.min(MAX_TRANSFER)))
            .take(RECORD_RUNS)
            .collect();
        if !runs.is_empty() && self.declares() {
            let tid = rustix::thread::gettid().as_raw_nonzero().get() as u32;
            hold.record = self.declare(tid, &runs);
        }
        hold
    }

    /// Whether the write of thread `tid` (a fault's thread id) that faulted at page `va`
    /// is declared to overwrite it whole, by a record made less than
    /// [`DECLARATION_FRESH_NS`] before `now_ns` (`CLOCK_MONOTONIC`); if so, every run the
    /// declaration lists, as (first page's address, pages). `None` for a record being
    /// written or withdrawn meanwhile (read under its seqlock), stale, or from the future,
    /// and for a thread id two fresh records name (a writer killed inside its call, and
    /// another thread with its id since, in another pid namespace: which one is blocked
    /// in the fault cannot be told).
    ///
    /// The caller must also know `tid` is not one of its own process's threads: a
    /// declaration is a promise about one call, which only a thread blocked inside that
    /// call (a writer from another process, faulting through `process_vm_writev`) keeps.
    pub fn declared_whole(&self, tid: u32, va: u64, now_ns: u64) -> Option<Vec<(u64, u64)>> {
        if tid == 0 || !self.declares() {
            return None;
        }
        let va = va & !(PAGE - 1);
        let mut named = 0;
        let mut found = None;
        for r in 0..RECORDS {
            match self.read_record(r, tid, now_ns) {
                Read::Other => {}
                Read::Unsure => return None,
                Read::Fresh(runs) => {
                    named += 1;
                    let covers = runs
                        .iter()
                        .any(|&(a, p)| va >= a && va < a.saturating_add(p * PAGE));
                    if covers {
                        found = Some(runs);
                    }
                }
            }
        }
        found.filter(|_| named == 1)
    }

    /// Record `r` read for thread `tid` at `now_ns` (see [`Read`]).
    fn read_record(&self, r: usize, tid: u32, now_ns: u64) -> Read {
        let rec = self.record(r);
        if rec.owner.load(Ordering::SeqCst) != tid {
            return Read::Other;
        }
        let s1 = rec.seq.load(Ordering::SeqCst);
        if s1 & 1 == 1 {
            return Read::Unsure;
        }
        let stamp = rec.stamp.load(Ordering::SeqCst);
        let n = (rec.runs.load(Ordering::SeqCst) as usize).min(RECORD_RUNS);
        let runs: Vec<(u64, u64)> = (0..n)
            .map(|i| unpack_run(self.run(r, i).load(Ordering::SeqCst)))
            .collect();
        if rec.seq.load(Ordering::SeqCst) != s1 || rec.owner.load(Ordering::SeqCst) != tid {
            return Read::Unsure;
        }
        if stamp > now_ns || now_ns - stamp >= DECLARATION_FRESH_NS {
            return Read::Other;
        }
        Read::Fresh(runs)
    }

    /// Makes a declaration of `runs` (packed) by thread `tid` in a free record; its index,
    /// or `None` if every record is taken.
    fn declare(&self, tid: u32, runs: &[u64]) -> Option<usize> {
        // A thread declares for one call at a time, so a record with its id now is a
        // leftover of a writer killed inside its call that had the same id.
        for r in 0..RECORDS {
            if self.record(r).owner.load(Ordering::SeqCst) == tid {
                self.withdraw(r);
            }
        }
        let r = (0..RECORDS).find(|&r| {
            self.record(r)
                .owner
                .compare_exchange(0, tid, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        })?;
        let rec = self.record(r);
        rec.seq.fetch_add(1, Ordering::SeqCst); // odd: being written
        rec.stamp
            .store(crate::proc::monotonic_ns(), Ordering::SeqCst);
        for (i, &run) in runs.iter().enumerate() {
            self.run(r, i).store(run, Ordering::SeqCst);
        }
        rec.runs.store(runs.len() as u32, Ordering::SeqCst);
        rec.seq.fetch_add(1, Ordering::SeqCst); // even: valid
        Some(r)
    }

    /// Withdraws declaration `r` (after its call returned) and frees its record.
    fn withdraw(&self, r: usize) {
        let rec = self.record(r);
        rec.seq.fetch_add(1, Ordering::SeqCst);
        rec.runs.store(0, Ordering::SeqCst);
        rec.seq.fetch_add(1, Ordering::SeqCst);
        rec.owner.store(0, Ordering::SeqCst);
    }

    fn record(&self, r: usize) -> &Record {
        assert!(r < RECORDS && self.declares());
        // SAFETY: record r < RECORDS lies inside the mapping (LEN), 4 KiB-aligned; Record
        // is atomics only, 24 bytes, within the record's first bytes.
        unsafe {
            &*self
                .base
                .as_ptr()
                .add(RECORDS_AT + r * RECORD)
                .cast::<Record>()
        }
    }

    fn run(&self, r: usize, i: usize) -> &AtomicU64 {
        assert!(r < RECORDS && i < RECORD_RUNS && self.declares());
        // SAFETY: run i < RECORD_RUNS of record r: 8-byte aligned, after the record's
        // 32-byte head, inside its 4 KiB (32 + 8 × 508 = 4096).
        unsafe {
            &*self
                .base
                .as_ptr()
                .add(RECORDS_AT + r * RECORD + 32 + 8 * i)
                .cast::<AtomicU64>()
        }
    }

    /// Closes the fence for good: every page is busy from now on (see the module). Call
    /// before the first call whose copy may land after it returns.
    pub fn close(&self) {
        self.closed().store(1, Ordering::SeqCst);
    }

    /// Whether the fence was closed ([`WriteFence::close`]).
    pub fn is_closed(&self) -> bool {
        self.closed().load(Ordering::SeqCst) != 0
    }

    /// Whether a writer may be copying into the page at `va`: ask after write-protecting
    /// it, before reading it. Always, once the fence is closed.
    pub fn busy(&self, va: u64) -> bool {
        self.is_closed() || self.slot(Self::slot_of(va / CHUNK)).load(Ordering::SeqCst) != 0
    }
}

/// A whole-page declaration's head, in the fence memfd (see [`WriteFence::declare`]).
#[repr(C)]
struct Record {
    /// Seqlock: odd while the record is written or withdrawn.
    seq: AtomicU32,
    /// The declaring thread's id; 0: free.
    owner: AtomicU32,
    /// Runs listed.
    runs: AtomicU32,
    _pad: AtomicU32,
    /// When it was declared, `CLOCK_MONOTONIC` ns.
    stamp: AtomicU64,
}

/// The runs of whole 4 KiB pages inside `[va, va + len)`, packed (page address | pages −
/// 1), each at most [`RUN_PAGES`].
fn whole_runs(va: u64, len: u64) -> Vec<u64> {
    let first = va.div_ceil(PAGE).saturating_mul(PAGE);
    let end = va.saturating_add(len) & !(PAGE - 1);
    let mut runs = Vec::new();
    let mut a = first;
    while a < end {
        let pages = ((end - a) / PAGE).min(RUN_PAGES);
        runs.push(a | (pages - 1));
        a += pages * PAGE;
    }
    runs
}

/// A packed run as (first page's address, pages).
fn unpack_run(run: u64) -> (u64, u64) {
    (run & !(PAGE - 1), (run & (PAGE - 1)) + 1)
}

/// A record as [`WriteFence::read_record`] found it for one thread.
enum Read {
    /// Another thread's, free, or stale.
    Other,
    /// The thread's, but being written or withdrawn (or changed while read): nothing can
    /// be trusted.
    Unsure,
    /// The thread's own, fresh: its runs.
    Fresh(Vec<(u64, u64)>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_finds_its_own_fence_and_holds_are_seen_through_both_mappings() {
        let agent = WriteFence::create().unwrap();
        let me = rustix::process::pidfd_open(
            rustix::process::getpid(),
            rustix::process::PidfdFlags::empty(),
        )
        .unwrap();
        assert!(
            WriteFence::of_process(me.as_fd(), std::process::id())
                .unwrap()
                .is_some(),
            "a fence is among this process's descriptors"
        );
        // Other tests make fences too: this one's, by its descriptor.
        let device = WriteFence::checked(agent._fd.try_clone().unwrap(), "this").unwrap();
        let va = 0x7f00_0000_0000u64;
        assert!(!agent.busy(va));
        {
            let _h = device.hold([(va + 4096, 3 * CHUNK)]);
            assert!(agent.busy(va) && agent.busy(va + 3 * CHUNK + 4095));
        }
        assert!(!agent.busy(va) && !agent.busy(va + 3 * CHUNK));
        // Sealed: the memfd cannot be shrunk under a device's mapping.
        assert!(rustix::fs::ftruncate(&agent._fd, 0).is_err());
        // Closed by a writer whose copies land later: every page busy, for good.
        assert!(!agent.is_closed());
        device.close();
        assert!(agent.is_closed() && agent.busy(va) && agent.busy(0));
    }

    fn my_tid() -> u32 {
        rustix::thread::gettid().as_raw_nonzero().get() as u32
    }

    #[test]
    fn a_declaration_names_its_thread_s_whole_pages_for_the_call_and_goes_with_it() {
        let f = WriteFence::create().unwrap();
        let va = 0x7f00_0000_0000u64;
        let now = crate::proc::monotonic_ns;
        {
            // Bytes 100.. of page 0 to byte 99 of page 3: pages 1 and 2 whole.
            let _h = f.hold_writing(&[(va + 100, 3 * PAGE), (va + 10 * PAGE, PAGE)]);
            let runs = f.declared_whole(my_tid(), va + PAGE + 5, now());
            assert_eq!(runs, Some(vec![(va + PAGE, 2), (va + 10 * PAGE, 1)]));
            assert!(f.declared_whole(my_tid(), va + 10 * PAGE, now()).is_some());
            assert_eq!(
                f.declared_whole(my_tid(), va, now()),
                None,
                "page 0 is partial"
            );
            assert_eq!(
                f.declared_whole(my_tid(), va + 3 * PAGE, now()),
                None,
                "page 3 too"
            );
            assert_eq!(
                f.declared_whole(my_tid() + 1, va + PAGE, now()),
                None,
                "another thread"
            );
            assert_eq!(f.declared_whole(0, va + PAGE, now()), None);
            let later = now() + DECLARATION_FRESH_NS;
            assert_eq!(f.declared_whole(my_tid(), va + PAGE, later), None, "stale");
            assert_eq!(
                f.declared_whole(my_tid(), va + PAGE, 0),
                None,
                "from the future"
            );
            assert!(
                f.busy(va) && f.busy(va + 10 * PAGE),
                "the chunks are held too"
            );
            // Being written or withdrawn (odd): not trusted.
            f.record(0).seq.fetch_add(1, Ordering::SeqCst);
            assert_eq!(f.declared_whole(my_tid(), va + PAGE, now()), None, "torn");
            f.record(0).seq.fetch_add(1, Ordering::SeqCst);
            assert!(f.declared_whole(my_tid(), va + PAGE, now()).is_some());
        }
        assert_eq!(
            f.declared_whole(my_tid(), va + PAGE, now()),
            None,
            "withdrawn"
        );
        assert!(!f.busy(va));
        assert!((0..RECORDS).all(|r| f.record(r).owner.load(Ordering::SeqCst) == 0));
        // No whole page: nothing declared, only held.
        let h = f.hold_writing(&[(va + 8, 16)]);
        assert_eq!(h.record, None);
        assert!(f.busy(va));
    }

    #[test]
    fn with_every_record_taken_a_write_is_only_held_and_its_pages_copied() {
        let f = WriteFence::create().unwrap();
        let va = 0x7f00_0000_0000u64;
        for r in 0..RECORDS {
            assert_eq!(f.declare(1000 + r as u32, &whole_runs(va, PAGE)), Some(r));
        }
        let h = f.hold_writing(&[(va + PAGE, PAGE)]);
        assert_eq!(h.record, None);
        assert!(f.busy(va + PAGE));
        assert_eq!(
            f.declared_whole(my_tid(), va + PAGE, crate::proc::monotonic_ns()),
            None
        );
        drop(h);
        f.withdraw(5);
        let h = f.hold_writing(&[(va + PAGE, PAGE)]);
        assert_eq!(h.record, Some(5), "a withdrawn record is free again");
    }

    #[test]
    fn a_killed_writer_s_leftover_is_withdrawn_by_its_id_and_two_records_of_one_id_are_not_trusted()
    {
        let f = WriteFence::create().unwrap();
        let va = 0x7f00_0000_0000u64;
        let now = crate::proc::monotonic_ns;
        // Thread 7 killed inside its call: its record stays.
        assert_eq!(f.declare(7, &whole_runs(va, PAGE)), Some(0));
        // A thread with the same id (another pid namespace) declares: the leftover goes.
        assert_eq!(f.declare(7, &whole_runs(va + PAGE, PAGE)), Some(0));
        assert_eq!(f.declared_whole(7, va, now()), None, "the leftover's page");
        assert_eq!(
            f.declared_whole(7, va + PAGE, now()),
            Some(vec![(va + PAGE, 1)])
        );
        // Two fresh records naming one id (a forged one, or made between the two
        // lookups): which one the faulting thread is blocked in cannot be told.
        assert_eq!(f.declare(8, &whole_runs(va + 2 * PAGE, PAGE)), Some(1));
        f.record(1).owner.store(7, Ordering::SeqCst);
        assert_eq!(f.declared_whole(7, va + PAGE, now()), None);
        assert_eq!(f.declared_whole(7, va + 2 * PAGE, now()), None);
        f.withdraw(1);
        assert_eq!(
            f.declared_whole(7, va + PAGE, now()),
            Some(vec![(va + PAGE, 1)])
        );
    }

    #[test]
    fn a_first_fence_is_held_and_declares_nothing() {
        let fd = rustix::fs::memfd_create(FENCE_NAME, MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, LEN_V1 as u64).unwrap();
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
        let agent = WriteFence::map(fd.try_clone().unwrap(), LEN_V1).unwrap();
        agent.magic().store(MAGIC_V1, Ordering::SeqCst);
        let device = WriteFence::checked(fd, "v1").unwrap();
        assert!(!device.declares());
        let va = 0x7f00_0000_0000u64;
        let h = device.hold_writing(&[(va, 4 * PAGE)]);
        assert!(agent.busy(va) && h.record.is_none());
        let now = crate::proc::monotonic_ns();
        assert_eq!(agent.declared_whole(my_tid(), va, now), None);
    }

    #[test]
    fn whole_runs_pack_page_runs_of_at_most_run_pages() {
        assert_eq!(whole_runs(0, PAGE - 1), Vec::<u64>::new());
        assert_eq!(whole_runs(1, 2 * PAGE), vec![PAGE]);
        let big = whole_runs(PAGE, (RUN_PAGES + 3) * PAGE);
        assert_eq!(
            big.iter().map(|&r| unpack_run(r)).collect::<Vec<_>>(),
            vec![(PAGE, RUN_PAGES), (PAGE + RUN_PAGES * PAGE, 3)]
        );
        assert_eq!(whole_runs(u64::MAX - 10, 100), Vec::<u64>::new());
    }

    #[test]
    fn a_bogus_length_holds_at_most_one_call_s_worth_and_never_overflows() {
        let f = WriteFence::create().unwrap();
        let h = f.hold([(u64::MAX - 10, u64::MAX), (0, u64::MAX)]);
        assert!(h.slots.len() <= 1 + (MAX_TRANSFER / CHUNK + 1) as usize);
        assert!(f.busy(0) && f.busy(u64::MAX - 10));
        drop(h);
        assert!(!f.busy(0));
    }

    #[test]
    fn a_memfd_named_as_the_fence_but_not_sealed_or_sized_is_refused() {
        let fake = rustix::fs::memfd_create(FENCE_NAME, MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fake, LEN as u64).unwrap();
        let e = WriteFence::checked(fake, "fake").unwrap_err();
        assert!(e.to_string().contains("not sealed"), "{e}");
        let small = rustix::fs::memfd_create(FENCE_NAME, MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&small, 4096).unwrap();
        rustix::fs::fcntl_add_seals(&small, SealFlags::SHRINK).unwrap();
        let e = WriteFence::checked(small, "small").unwrap_err();
        assert!(e.to_string().contains("wrong size"), "{e}");
        let blank = rustix::fs::memfd_create(FENCE_NAME, MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&blank, LEN as u64).unwrap();
        rustix::fs::fcntl_add_seals(&blank, SealFlags::SHRINK).unwrap();
        let e = WriteFence::checked(blank, "blank").unwrap_err();
        assert!(e.to_string().contains("no magic"), "{e}");
        // A FIFO (what a hostile QEMU could put where the fence was) is refused without
        // blocking: nothing is opened, and a FIFO has no seals.
        let dir = std::env::temp_dir().join(format!("fence-fifo-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &dir,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR,
            0,
        )
        .unwrap();
        let fifo = rustix::fs::open(
            &dir,
            rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NONBLOCK,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        let _ = std::fs::remove_file(&dir);
        let e = WriteFence::checked(fifo, "fifo").unwrap_err();
        assert!(e.to_string().contains("no seals"), "{e}");
    }
}
