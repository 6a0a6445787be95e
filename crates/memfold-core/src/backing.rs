//! Where bytes live, behind traits: the engine decides, a backing stores. As rust-vmm's
//! `vm-memory` separates the users of guest memory from its providers, the engine reads
//! guests through [`GuestRam`] and keeps frames and blobs in [`Backing`]s, so that the
//! code the reference model proves is the code memfoldd runs on memfds and files.
//!
//! | backing | live (memfold-live) | model and `bench micro` ([`mem`]) |
//! |---|---|---|
//! | the pool of frames | a memfd every agent maps | [`mem::MemBacking`] |
//! | the store of blobs | a memfd the agents read | [`mem::MemBacking`] |
//! | the swap file | a file on disk | [`mem::MemBacking`] |
//! | a guest's RAM | QEMU's RAM memfd | [`mem::MemGuestRam`] |

use crate::ids::Gfn;

/// A backing's failure: what it was doing and why. The engine leaves guest memory as it
/// was when a backing fails (a share, stash or swap-out is a hint).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {why}")]
pub struct BackingError {
    /// The operation and where (e.g. "pool pwrite at 8192").
    pub what: String,
    /// The cause (errno text).
    pub why: String,
}

impl BackingError {
    /// An error for operation `what` caused by `why`.
    pub fn new(what: impl Into<String>, why: impl std::fmt::Display) -> Self {
        BackingError {
            what: what.into(),
            why: why.to_string(),
        }
    }
}

/// A byte-addressed store the engine manages the layout of: the pool (frame `f` at
/// `f·4096`), the store of blobs, the swap file.
pub trait Backing: Send {
    /// Reads `out.len()` bytes at `offset`.
    ///
    /// Errors: the read failed or ran past the end.
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BackingError>;
    /// Writes `bytes` at `offset` (inside the size set by [`Backing::resize`]).
    ///
    /// Errors: the write failed (ENOSPC, ENOMEM, EIO).
    fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), BackingError>;
    /// Sets the size, bytes (growing leaves holes that take no memory).
    ///
    /// Errors: the size could not be set.
    fn resize(&mut self, bytes: u64) -> Result<(), BackingError>;
    /// Frees `[offset, offset+len)`: nothing needs those bytes any more (a hole).
    fn release(&mut self, offset: u64, len: u64);
    /// Makes what was written durable and drops it from the host's cache (the swap file:
    /// swapped pages must really leave host memory). Nothing for memory backings.
    ///
    /// Errors: the write-back failed.
    fn sync(&mut self) -> Result<(), BackingError>;
    /// Bytes of host memory (or disk) the backing holds, holes taking none.
    fn allocated_bytes(&self) -> u64;
    /// Sends the listed pages (page indices, ascending) that are in RAM and mapped by no
    /// process to the kernel's swap — zswap where the host has it on — with their bytes
    /// unchanged: a later read brings each back in (issue 15, a pool's frames that only
    /// patches hold; `engine/kernel_swap.rs`). Returns how many left RAM. The default, a
    /// backing with no such swap, keeps them all.
    ///
    /// Errors: the kernel refused the mapping or the advice (no page's bytes change).
    fn page_out(&mut self, pages: &[u64]) -> Result<u64, BackingError> {
        let _ = pages;
        Ok(0)
    }
    /// Bytes of [`Backing::allocated_bytes`] in the kernel's swap now, not in RAM (0 for a
    /// backing that never pages out).
    fn swapped_bytes(&self) -> u64 {
        0
    }
}

/// One guest's RAM as the engine reads it (the live layer: QEMU's memfd, with pread).
pub trait GuestRam: Send {
    /// Reads pages `[first, first + out.len()/4096)` into `out`.
    ///
    /// Errors: the read failed.
    fn read(&self, first: Gfn, out: &mut [u8]) -> Result<(), BackingError>;
    /// The first run `[a, b)` of pages at or after `from` and before `end` that hold data
    /// (not holes: never touched, or punched); `None` if there is none.
    fn next_data_run(&self, from: Gfn, end: Gfn) -> Option<(Gfn, Gfn)>;
    /// Bytes of host memory the guest's RAM holds, holes taking none.
    fn allocated_bytes(&self) -> u64;
}

/// What the engine reads the time from: µs and ns since any fixed origin. The live layer
/// passes a monotonic clock; the model and benchmarks a clock they move themselves.
pub trait Clock: Send {
    /// Microseconds since the clock's origin.
    fn now_us(&self) -> u64;
    /// Nanoseconds since the clock's origin (for operation latencies).
    fn now_ns(&self) -> u64 {
        self.now_us() * 1000
    }
}

/// In-memory backings, guest RAM and clock: for the reference model, `bench micro` and
/// tests. Each is a cheap handle onto shared state, so that the engine and a simulated
/// agent see the same bytes, as memfoldd and the real agents share memfds.
pub mod mem {
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex, MutexGuard};

    use super::{Backing, BackingError, Clock, GuestRam};
    use crate::ids::Gfn;
    use crate::PAGE_SIZE;

    const PAGE: u64 = PAGE_SIZE as u64;

    /// A sparse in-memory file: bytes and which 4 KiB pages hold data.
    #[derive(Default)]
    pub struct MemFile {
        /// The bytes (its length is the file size).
        pub bytes: Vec<u8>,
        /// Pages written and not released since.
        pub allocated: BTreeSet<u64>,
        /// Fail every write from now on (injected ENOSPC), as a real `pwrite` may: all but
        /// the write's last byte land first (a short write, then the error), so a caller
        /// must not take a failed write to have left the file as it was.
        pub fail_writes: bool,
        /// Fail every sync from now on (injected EIO). A failed sync loses what was
        /// written since the last good one, as a failed write-back of a file does once
        /// its page cache is dropped: the bytes revert to [`MemFile::durable`].
        pub fail_sync: bool,
        /// The bytes as the last good sync left them on "disk".
        pub durable: Vec<u8>,
        /// Pages in the kernel's swap (a guest RAM page the agent paged out, issue 15's
        /// zswap backing): still data, and their bytes stay here (the kernel keeps them),
        /// but a read through the file brings them back into RAM, as a `pread` of a
        /// memfd does ([`MemFile::swapped_in_by_reads`]). A punch frees them.
        pub swapped: BTreeSet<u64>,
        /// Pages of [`MemFile::swapped`] that reads through the backing (memfoldd's and,
        /// for a pool, the agents' decodes and the guests' reads of pages mapped onto
        /// frames) brought back into RAM.
        pub swapped_in_by_reads: u64,
        /// Pages some process maps now, with how many mappings (for a pool: guest pages
        /// on the frame whose PTE is present). [`Backing::page_out`] leaves them in RAM,
        /// as `MADV_PAGEOUT` does a page mapped elsewhere.
        pub mapped: BTreeMap<u64, u32>,
        /// Times guest RAM was asked where its data lies ([`GuestRam::next_data_run`]:
        /// a `SEEK_DATA`/`SEEK_HOLE` pair each for memfoldd's memfd).
        pub data_asks: u64,
    }

    impl MemFile {
        /// Marks the pages of `[offset, offset+len)` as holding data.
        pub fn touch(&mut self, offset: u64, len: u64) {
            for p in offset / PAGE..(offset + len).div_ceil(PAGE) {
                self.allocated.insert(p);
            }
        }

        /// Punches `[offset, offset+len)`: zeros, and whole pages no longer allocated.
        pub fn punch(&mut self, offset: u64, len: u64) {
            let end = (offset + len).min(self.bytes.len() as u64);
            if offset < end {
                self.bytes[offset as usize..end as usize].fill(0);
            }
            let end = (offset + len).min(self.durable.len() as u64);
            if offset < end {
                self.durable[offset as usize..end as usize].fill(0);
            }
            for p in offset.div_ceil(PAGE)..(offset + len) / PAGE {
                self.allocated.remove(&p);
                self.swapped.remove(&p);
            }
        }
    }

    /// A [`Backing`] in memory; clones share the bytes.
    #[derive(Clone, Default)]
    pub struct MemBacking(Arc<Mutex<MemFile>>);

    impl MemBacking {
        /// An empty backing.
        pub fn new() -> Self {
            Self::default()
        }

        /// The shared file, locked.
        pub fn file(&self) -> MutexGuard<'_, MemFile> {
            self.0.lock().expect("no thread panics holding it")
        }
    }

    impl Backing for MemBacking {
        fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BackingError> {
            let mut f = self.file();
            let end = offset as usize + out.len();
            if end > f.bytes.len() {
                return Err(BackingError::new(
                    format!("read of {} bytes at {offset}", out.len()),
                    format!("past the end ({} bytes)", f.bytes.len()),
                ));
            }
            out.copy_from_slice(&f.bytes[offset as usize..end]);
            // A read brings pages in the kernel's swap back into RAM, as a pread does.
            for p in offset / PAGE..(end as u64).div_ceil(PAGE) {
                if f.swapped.remove(&p) {
                    f.swapped_in_by_reads += 1;
                }
            }
            Ok(())
        }

        fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), BackingError> {
            let mut f = self.file();
            let end = offset as usize + bytes.len();
            if f.fail_writes && end <= f.bytes.len() && bytes.len() > 1 {
                let short = bytes.len() - 1;
                f.bytes[offset as usize..offset as usize + short].copy_from_slice(&bytes[..short]);
                f.touch(offset, short as u64);
            }
            if f.fail_writes || end > f.bytes.len() {
                return Err(BackingError::new(
                    format!("write of {} bytes at {offset}", bytes.len()),
                    if f.fail_writes {
                        "no space left on device (injected)"
                    } else {
                        "past the end"
                    },
                ));
            }
            f.bytes[offset as usize..end].copy_from_slice(bytes);
            f.touch(offset, bytes.len() as u64);
            // A write brings a swapped page back into RAM first.
            for p in offset / PAGE..(end as u64).div_ceil(PAGE) {
                f.swapped.remove(&p);
            }
            Ok(())
        }

        fn resize(&mut self, bytes: u64) -> Result<(), BackingError> {
            let mut f = self.file();
            f.bytes.resize(bytes as usize, 0);
            let pages = bytes.div_ceil(PAGE);
            f.allocated.retain(|&p| p < pages);
            f.swapped.retain(|&p| p < pages);
            Ok(())
        }

        fn release(&mut self, offset: u64, len: u64) {
            self.file().punch(offset, len);
        }

        fn sync(&mut self) -> Result<(), BackingError> {
            let mut f = self.file();
            if f.fail_sync {
                let mut lost = f.durable.clone();
                lost.resize(f.bytes.len(), 0);
                f.bytes = lost;
                return Err(BackingError::new("sync", "input/output error (injected)"));
            }
            f.durable = f.bytes.clone();
            Ok(())
        }

        fn allocated_bytes(&self) -> u64 {
            self.file().allocated.len() as u64 * PAGE
        }

        fn page_out(&mut self, pages: &[u64]) -> Result<u64, BackingError> {
            let mut f = self.file();
            let mut left = 0;
            for &p in pages {
                if f.mapped.contains_key(&p) {
                    continue;
                }
                if f.allocated.contains(&p) && f.swapped.insert(p) {
                    left += 1;
                }
            }
            Ok(left)
        }

        fn swapped_bytes(&self) -> u64 {
            self.file().swapped.len() as u64 * PAGE
        }
    }

    /// A guest's RAM in memory; clones share it (the simulated agent writes it).
    #[derive(Clone)]
    pub struct MemGuestRam(MemBacking);

    impl MemGuestRam {
        /// Guest RAM of `pages` pages, all holes.
        pub fn new(pages: u32) -> Self {
            let mut b = MemBacking::new();
            b.resize(pages as u64 * PAGE).expect("memory resize");
            MemGuestRam(b)
        }

        /// The shared file, locked.
        pub fn file(&self) -> MutexGuard<'_, MemFile> {
            self.0.file()
        }
    }

    impl GuestRam for MemGuestRam {
        fn read(&self, first: Gfn, out: &mut [u8]) -> Result<(), BackingError> {
            // Swapped pages read come back into RAM (`MemBacking::read`).
            self.0.read(first.offset(), out)
        }

        fn next_data_run(&self, from: Gfn, end: Gfn) -> Option<(Gfn, Gfn)> {
            let mut f = self.file();
            f.data_asks += 1;
            let a = *f.allocated.range(from.0 as u64..end.0 as u64).next()?;
            let mut b = a + 1;
            while b < end.0 as u64 && f.allocated.contains(&b) {
                b += 1;
            }
            Some((Gfn(a as u32), Gfn(b as u32)))
        }

        fn allocated_bytes(&self) -> u64 {
            self.0.allocated_bytes()
        }
    }

    /// A clock that moves only when told; clones share it.
    #[derive(Clone, Default)]
    pub struct ManualClock(Arc<AtomicU64>);

    impl ManualClock {
        /// A clock at 0 µs.
        pub fn new() -> Self {
            Self::default()
        }

        /// Moves the clock forward by `us` microseconds.
        pub fn advance(&self, us: u64) {
            self.0.fetch_add(us, Ordering::Relaxed);
        }
    }

    impl Clock for ManualClock {
        fn now_us(&self) -> u64 {
            self.0.load(Ordering::Relaxed)
        }
    }
}
