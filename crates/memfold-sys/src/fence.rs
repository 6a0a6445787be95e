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
//! Records are claimed by a compare-and-swap of their owner word, so one writer at a
//! time writes each; a writer killed inside its call leaves its record, which the next
//! write by a thread with its id withdraws, and which any writer takes once its process
//! is gone and it is stale (`WriteFence::declare`). Devices built before records
//! carried a process id must not share a fence with later ones (restart them together).
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

/// A record's owner word while one writer makes, reclaims or withdraws it: no thread
/// has this id (Linux's ids stay under 2^22), so no agent reads it, and no other writer
/// takes it.
const LOCKED: u32 = u32::MAX;

/// The header: the magic at 0, the closed flag at [`CLOSED_AT`].
const HEADER: usize = 4096;
const CLOSED_AT: usize = 8;
/// Bytes one read or write system call transfers at most (Linux's `MAX_RW_COUNT`).
const MAX_TRANSFER: u64 = 0x7fff_f000;
/// One declaration: seq (4 bytes), owner (4), runs (4), pid (4), stamp (8), then
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
    /// The declaration's record and the thread id it was made under.
    record: Option<(usize, u32)>,
}

impl Drop for FenceHold<'_> {
    fn drop(&mut self) {
        if let Some((r, tid)) = self.record {
            self.fence.withdraw(r, tid);
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
    /// whole or no record is free. Either way, withdraws what a killed writer left under
    /// the calling thread's id (see `WriteFence::declare`): a thread that may ever
    /// declare writes only through this, never through [`WriteFence::hold`] alone.
    pub fn hold_writing(&self, ranges: &[(u64, u64)]) -> FenceHold<'_> {
        let mut hold = self.hold(ranges.iter().copied());
        if !self.declares() {
            return hold;
        }
        let runs: Vec<u64> = ranges
            .iter()
            .flat_map(|&(va, len)| whole_runs(va, len.min(MAX_TRANSFER)))
            .take(RECORD_RUNS)
            .collect();
        let tid = rustix::thread::gettid().as_raw_nonzero().get() as u32;
        if runs.is_empty() {
            // Declaring nothing, the call must not be covered by a leftover of its id
            // either: a fault in it would have the leftover's pages zeroed.
            self.withdraw_leftovers(tid);
        } else {
            let pid = rustix::process::getpid().as_raw_nonzero().get() as u32;
            hold.record = self.declare(pid, tid, &runs).map(|r| (r, tid));
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
        if tid == 0 || tid == LOCKED || !self.declares() {
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

    /// Makes a declaration of `runs` (packed) by thread `tid` of process `pid` in a free
    /// record, or else in a leaked one ([`WriteFence::leaked`]); its index, or `None` if
    /// every record is taken.
    ///
    /// Invariant: a record is written only by the writer that moved its owner word to
    /// [`LOCKED`] (a compare-and-swap, so by one at a time), and is published by storing
    /// the writer's id last; an agent reads only records whose owner is the faulting
    /// thread, under the seqlock. So a record is never written by two writers at once,
    /// and a writer whose record was reclaimed meanwhile withdraws nothing of another's.
    ///
    /// A writer killed between taking a record and publishing it (a few hundred stores)
    /// leaves it locked for good: a locked record is never taken, since whether its
    /// writer lives cannot be known for sure (another pid namespace), and two writers in
    /// one record could publish one's id over the other's runs.
    fn declare(&self, pid: u32, tid: u32, runs: &[u64]) -> Option<usize> {
        self.withdraw_leftovers(tid);
        let now = crate::proc::monotonic_ns();
        let r = (0..RECORDS).find(|&r| self.lock(r, 0)).or_else(|| {
            (0..RECORDS).find(|&r| self.leaked(r, now).is_some_and(|o| self.lock(r, o)))
        })?;
        self.under_seqlock(r, |rec| {
            rec.pid.store(pid, Ordering::SeqCst);
            rec.stamp.store(now, Ordering::SeqCst);
            for (i, &run) in runs.iter().enumerate() {
                self.run(r, i).store(run, Ordering::SeqCst);
            }
            rec.runs.store(runs.len() as u32, Ordering::SeqCst);
        });
        self.record(r).owner.store(tid, Ordering::SeqCst); // published
        Some(r)
    }

    /// Writes record `r`, which the caller locked, with `write` inside its seqlock: odd
    /// while `write` runs, whatever seq was left (a device built before the lock, killed
    /// mid-write, left it odd), even (valid) after.
    fn under_seqlock(&self, r: usize, write: impl FnOnce(&Record)) {
        let rec = self.record(r);
        let odd = rec.seq.load(Ordering::SeqCst).wrapping_add(1) | 1;
        rec.seq.store(odd, Ordering::SeqCst);
        write(rec);
        rec.seq.store(odd.wrapping_add(1), Ordering::SeqCst);
    }

    /// Takes record `r` for writing if its owner word is `from`.
    fn lock(&self, r: usize, from: u32) -> bool {
        self.record(r)
            .owner
            .compare_exchange(from, LOCKED, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Withdraws every record made under thread id `tid`: a thread declares for one
    /// call at a time, so such a record is a leftover of a writer killed inside its call
    /// that had the same id (this one, reused; or another pid namespace's).
    fn withdraw_leftovers(&self, tid: u32) {
        for r in 0..RECORDS {
            if self.record(r).owner.load(Ordering::SeqCst) == tid {
                self.withdraw(r, tid);
            }
        }
    }

    /// Record `r`'s owner, if the record is leaked: declared by a process that is gone
    /// (`kill(pid, 0)` finds none: a device killed inside its call) and stale at `now_ns`
    /// (so no agent trusts it any more). Without this, each device killed mid-write
    /// would leave a record for good, and after [`RECORDS`] of them no write into that
    /// QEMU's guest would be declared again.
    ///
    /// Never taken: a record of unknown process (0, or not a valid pid: QEMU may write
    /// anything here), one whose pid names a live process here (a reused pid; a device
    /// in a container whose pid there is 1), one stamped in the future, one locked. A
    /// record whose process runs in another pid namespace may look gone and be taken
    /// while its writer is still inside a call of more than 10 s, or just withdrew it
    /// and declared again in it: that writer's declaration is lost and its pages are
    /// copied, as before; its later withdrawal finds the record another's and leaves it.
    fn leaked(&self, r: usize, now_ns: u64) -> Option<u32> {
        let rec = self.record(r);
        let owner = rec.owner.load(Ordering::SeqCst);
        let pid = rec.pid.load(Ordering::SeqCst);
        let stamp = rec.stamp.load(Ordering::SeqCst);
        let stale = stamp <= now_ns && now_ns - stamp >= DECLARATION_FRESH_NS;
        if owner == 0 || owner == LOCKED || !stale {
            return None;
        }
        let gone = i32::try_from(pid)
            .ok()
            .filter(|&p| p > 0)
            .and_then(rustix::process::Pid::from_raw)
            .is_some_and(|p| rustix::process::test_kill_process(p) == Err(rustix::io::Errno::SRCH));
        gone.then_some(owner)
    }

    /// Withdraws declaration `r` of thread `tid` (after its call returned) and frees its
    /// record; nothing if the record is no longer `tid`'s (reclaimed, or withdrawn as a
    /// leftover).
    fn withdraw(&self, r: usize, tid: u32) {
        if !self.lock(r, tid) {
            return;
        }
        self.under_seqlock(r, |rec| {
            rec.runs.store(0, Ordering::SeqCst);
            // Unknown again: a device built before records carried a pid, declaring here
            // next, must not leave this writer's (dead one day) pid on its live record.
            rec.pid.store(0, Ordering::SeqCst);
        });
        self.record(r).owner.store(0, Ordering::SeqCst);
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
    /// The declaring thread's id; 0: free; [`LOCKED`]: being written.
    owner: AtomicU32,
    /// Runs listed.
    runs: AtomicU32,
    /// The declaring thread's process id, as it sees it; 0: not said (free, or made by
    /// a device built before reclaiming: never taken).
    pid: AtomicU32,
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
mod tests;
