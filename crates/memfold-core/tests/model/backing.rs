//! The engine's own handles on its pools, stores, swap files and guest RAM, which fail as
//! `Op::Fail` tells them: a backing that cannot grow (ENOMEM, ENOSPC), reads that fail
//! (EIO). The agents' handles and the harness's checks read the same bytes through
//! handles that never fail: only memfoldd's reads are faulted.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use memfold_core::backing::mem::{MemBacking, MemGuestRam};
use memfold_core::backing::{Backing, BackingError, GuestRam};
use memfold_core::ids::Gfn;

/// Faults injected into the engine's handles, shared by all of them.
#[derive(Clone, Default)]
pub(super) struct EngineFaults(Arc<Faults>);

#[derive(Default)]
struct Faults {
    /// Growths, reads fail now.
    on: [AtomicBool; 2],
    /// Growths, reads failed so far.
    failed: [AtomicU64; 2],
}

const RESIZE: usize = 0;
const READS: usize = 1;

impl EngineFaults {
    /// Growing a pool, store or swap file fails from now on (`on`), or no longer.
    pub(super) fn fail_resize(&self, on: bool) {
        self.0.on[RESIZE].store(on, Ordering::Relaxed);
    }

    /// The engine's reads of its backings and of guest RAM fail from now on, or no longer.
    pub(super) fn fail_reads(&self, on: bool) {
        self.0.on[READS].store(on, Ordering::Relaxed);
    }

    pub(super) fn resize_failing(&self) -> bool {
        self.0.on[RESIZE].load(Ordering::Relaxed)
    }

    pub(super) fn reads_failing(&self) -> bool {
        self.0.on[READS].load(Ordering::Relaxed)
    }

    /// Read faults lifted until the guard drops: the invariant check reads the pool
    /// through the engine's own handle.
    pub(super) fn quiet(&self) -> Quiet<'_> {
        Quiet(self, self.0.on[READS].swap(false, Ordering::Relaxed))
    }

    /// Reads and growths the engine was refused so far.
    pub(super) fn failed(&self) -> [u64; 2] {
        [READS, RESIZE].map(|k| self.0.failed[k].load(Ordering::Relaxed))
    }

    fn read(&self, what: &str, offset: u64, len: usize) -> Result<(), BackingError> {
        if self.reads_failing() {
            self.0.failed[READS].fetch_add(1, Ordering::Relaxed);
            return Err(BackingError::new(
                format!("{what} read of {len} bytes at {offset}"),
                "input/output error (injected)",
            ));
        }
        Ok(())
    }

    /// A growth fails while injected; a shrink (nothing the engine asks today) never.
    fn grow(&self, from: u64, to: u64) -> Result<(), BackingError> {
        if self.resize_failing() && to > from {
            self.0.failed[RESIZE].fetch_add(1, Ordering::Relaxed);
            return Err(BackingError::new(
                format!("resize from {from} to {to} bytes"),
                "cannot allocate memory (injected)",
            ));
        }
        Ok(())
    }

    /// The engine's handle on `inner`.
    pub(super) fn backing(&self, inner: &MemBacking) -> Box<dyn Backing> {
        Box::new(Faulty(inner.clone(), self.clone()))
    }

    /// The engine's handle on guest RAM `inner`.
    pub(super) fn ram(&self, inner: &MemGuestRam) -> Box<dyn GuestRam> {
        Box::new(FaultyRam(inner.clone(), self.clone()))
    }
}

/// [`EngineFaults::quiet`]'s guard: restores the read fault.
pub(super) struct Quiet<'a>(&'a EngineFaults, bool);

impl Drop for Quiet<'_> {
    fn drop(&mut self) {
        self.0.fail_reads(self.1);
    }
}

struct Faulty(MemBacking, EngineFaults);

impl Backing for Faulty {
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BackingError> {
        self.1.read("backing", offset, out.len())?;
        self.0.read(offset, out)
    }

    fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), BackingError> {
        self.0.write(offset, bytes)
    }

    fn resize(&mut self, bytes: u64) -> Result<(), BackingError> {
        let size = self.0.file().bytes.len() as u64;
        self.1.grow(size, bytes)?;
        self.0.resize(bytes)
    }

    fn release(&mut self, offset: u64, len: u64) {
        self.0.release(offset, len)
    }

    fn sync(&mut self) -> Result<(), BackingError> {
        self.0.sync()
    }

    fn allocated_bytes(&self) -> u64 {
        self.0.allocated_bytes()
    }

    fn page_out(&mut self, pages: &[u64]) -> Result<u64, BackingError> {
        self.0.page_out(pages)
    }

    fn swapped_bytes(&self) -> u64 {
        self.0.swapped_bytes()
    }
}

struct FaultyRam(MemGuestRam, EngineFaults);

impl GuestRam for FaultyRam {
    fn read(&self, first: Gfn, out: &mut [u8]) -> Result<(), BackingError> {
        self.1.read("guest RAM", first.offset(), out.len())?;
        self.0.read(first, out)
    }

    fn next_data_run(&self, from: Gfn, end: Gfn) -> Option<(Gfn, Gfn)> {
        self.0.next_data_run(from, end)
    }

    fn allocated_bytes(&self) -> u64 {
        self.0.allocated_bytes()
    }
}
