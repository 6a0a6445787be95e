//! Guest access API: reads and writes with the semantics the live layer's fault handlers
//! need (ESX §4.3 CoW; DE §3 faults on patched, compressed and swapped pages).

use serde::Serialize;

use super::Engine;
use crate::error::{EngineError, Result};
use crate::types::{Frame, Gfn, Page, PageState, VmId, PAGE_SIZE};

/// What an access cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Access {
    /// Served from memory as mapped: private, shared (reads are free), or zero.
    Hit,
    /// First write to a zero or never-written page: a zeroed frame was allocated.
    ZeroFill,
    /// Write to a shared page: a private copy was made (or, as the last sharer, the frame
    /// was taken back without a copy).
    CowBreak,
    /// Fault on a patched page: rebuilt from its reference page.
    Unpatch,
    /// Fault on a compressed page: decompressed.
    Decompress,
    /// Fault on a swapped page: read back from swap.
    SwapIn,
}

impl Engine {
    fn check_access(&self, vm: VmId, gfn: Gfn, offset: usize, len: usize) -> Result<()> {
        self.check(vm, gfn)?;
        if offset.checked_add(len).is_none_or(|end| end > PAGE_SIZE) {
            return Err(EngineError::BadAccess {
                vm,
                gfn,
                offset,
                len,
            });
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset` of a guest page.
    ///
    /// Reading a private, shared, zero or never-written page is free. Reading a patched,
    /// compressed or swapped page is a fault: the page is rebuilt into a private frame (DE
    /// §3.3: "returns it to the VM uncompressed") and stays so until the clock picks it again.
    ///
    /// Errors: [`EngineError::NoSuchVm`], [`EngineError::GfnOutOfRange`],
    /// [`EngineError::BadAccess`]; for faults also [`EngineError::OutOfHostMemory`],
    /// [`EngineError::SwapIo`], [`EngineError::Corrupt`] — then nothing changed.
    pub fn read(&mut self, vm: VmId, gfn: Gfn, offset: usize, buf: &mut [u8]) -> Result<Access> {
        self.check_access(vm, gfn, offset, buf.len())?;
        let (access, frame) = match self.entry(vm, gfn).state() {
            PageState::Unbacked | PageState::Zero => {
                buf.fill(0);
                (Access::Hit, None)
            }
            PageState::Private(f) | PageState::Shared(f) => (Access::Hit, Some(f)),
            _ => {
                let (a, f) = self.fault_in(vm, gfn)?;
                (a, Some(f))
            }
        };
        if let Some(f) = frame {
            buf.copy_from_slice(&self.frames.data(f)[offset..offset + buf.len()]);
        }
        self.counters.reads += 1;
        self.vms.get_mut(&vm).expect("checked").clock[gfn as usize].touch(false);
        Ok(access)
    }

    /// Writes `data` at `offset` of a guest page (partial writes allowed).
    ///
    /// A write to a shared page is a CoW break; to a zero or never-written page it
    /// allocates a zeroed frame; to a patched, compressed or swapped page it first rebuilds
    /// the page (skipped when the write covers the whole page).
    ///
    /// Errors: as [`Engine::read`]; on error nothing changed.
    pub fn write(&mut self, vm: VmId, gfn: Gfn, offset: usize, data: &[u8]) -> Result<Access> {
        self.check_access(vm, gfn, offset, data.len())?;
        let whole = data.len() == PAGE_SIZE;
        let (access, f) = match self.entry(vm, gfn).state() {
            PageState::Private(f) => (Access::Hit, f),
            PageState::Shared(f) => (Access::CowBreak, self.cow_break(vm, gfn, f, whole)?),
            PageState::Unbacked | PageState::Zero => {
                let f = self.alloc_frame((vm, gfn))?;
                if !whole {
                    self.frames.data_mut(f).fill(0);
                }
                self.set_entry(vm, gfn, PageState::Private(f));
                self.counters.zero_fills += 1;
                (Access::ZeroFill, f)
            }
            old if whole => {
                // Overwritten entirely: no need to rebuild the old content.
                let f = self.alloc_frame((vm, gfn))?;
                let e = self.entry(vm, gfn);
                debug_assert_eq!(e.state(), old);
                self.release(e);
                self.set_entry(vm, gfn, PageState::Private(f));
                (Self::fault_kind(old), f)
            }
            _ => self.fault_in(vm, gfn)?,
        };
        self.frames.data_mut(f)[offset..offset + data.len()].copy_from_slice(data);
        self.counters.writes += 1;
        self.vms.get_mut(&vm).expect("checked").clock[gfn as usize].touch(true);
        Ok(access)
    }

    /// The guest gave the page back (balloon, free page reporting, or the micro-benchmark's
    /// free phase): whatever backs it is released and it reads as zeros.
    ///
    /// Errors: [`EngineError::NoSuchVm`], [`EngineError::GfnOutOfRange`].
    pub fn discard(&mut self, vm: VmId, gfn: Gfn) -> Result<()> {
        self.check(vm, gfn)?;
        let e = self.entry(vm, gfn);
        self.release(e);
        self.set_entry(vm, gfn, PageState::Unbacked);
        Ok(())
    }

    /// The page's content, decoded without changing any state, counter or clock bit (for
    /// verification, capture and analysis).
    ///
    /// Errors: [`EngineError::NoSuchVm`], [`EngineError::GfnOutOfRange`],
    /// [`EngineError::SwapIo`], [`EngineError::Corrupt`].
    pub fn peek(&self, vm: VmId, gfn: Gfn, out: &mut Page) -> Result<()> {
        self.check(vm, gfn)?;
        self.content(vm, gfn, out)
    }

    fn fault_kind(s: PageState) -> Access {
        match s {
            PageState::Patched(_) => Access::Unpatch,
            PageState::Compressed(_) => Access::Decompress,
            PageState::Swapped(_) => Access::SwapIn,
            _ => Access::Hit,
        }
    }

    /// Rebuilds a patched, compressed or swapped page into a private frame.
    fn fault_in(&mut self, vm: VmId, gfn: Gfn) -> Result<(Access, Frame)> {
        let mut page = [0u8; PAGE_SIZE];
        self.content(vm, gfn, &mut page)?;
        let e = self.entry(vm, gfn);
        let kind = Self::fault_kind(e.state());
        let f = match (self.alloc_frame((vm, gfn)), e.state()) {
            (Ok(f), _) => {
                self.release(e);
                f
            }
            (Err(EngineError::OutOfHostMemory { .. }), PageState::Swapped(slot)) => {
                self.swap_exchange(vm, gfn, slot, &page)?
            }
            (Err(err), _) => return Err(err),
        };
        self.frames.data_mut(f).copy_from_slice(&page);
        self.set_entry(vm, gfn, PageState::Private(f));
        match kind {
            Access::Unpatch => self.counters.unpatches += 1,
            Access::Decompress => self.counters.decompressions += 1,
            _ => self.counters.swap_ins += 1,
        }
        Ok((kind, f))
    }

    /// Swap-in with host memory and swap both full: the faulting page's slot (its content
    /// already read into `page`) is given back so that a victim can be swapped out into it.
    /// If no victim can go, the page goes back to swap; if even that fails, the page is kept
    /// over budget rather than lose guest data (counted in `budget_overruns`).
    fn swap_exchange(&mut self, vm: VmId, gfn: Gfn, slot: u32, page: &Page) -> Result<Frame> {
        self.swap.free(slot);
        self.set_entry(vm, gfn, PageState::Unbacked);
        match self.alloc_frame((vm, gfn)) {
            Ok(f) => Ok(f),
            Err(err) => match self.swap.put(page) {
                Ok(Some(s)) => {
                    self.set_entry(vm, gfn, PageState::Swapped(s));
                    Err(err)
                }
                _ => {
                    self.counters.budget_overruns += 1;
                    self.frames.alloc().ok_or(EngineError::FramesExhausted)
                }
            },
        }
    }

    /// Gives a page writing to shared frame `f` a private frame (ESX §4.3 copy-on-write).
    /// As the frame's only holder, takes it back without copying, as ESX does.
    fn cow_break(&mut self, vm: VmId, gfn: Gfn, f: Frame, whole: bool) -> Result<Frame> {
        self.counters.cow_breaks += 1;
        if self.frames.refcount(f) == 1 {
            self.unlist(f);
            self.set_entry(vm, gfn, PageState::Private(f));
            self.counters.cow_reuses += 1;
            return Ok(f);
        }
        let n = self.alloc_frame((vm, gfn))?;
        if !whole {
            let old = *self.frames.data(f);
            self.frames.data_mut(n).copy_from_slice(&old);
        }
        // The victim scan during alloc_frame never picks this page, so `f` is still ours.
        self.put_frame(f);
        self.set_entry(vm, gfn, PageState::Private(n));
        Ok(n)
    }
}
