//! Swap space: a slot allocator over a page-granular swap device (Difference Engine §3.4, §4.6).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde::Serialize;

use crate::types::{Page, SwapSlot, PAGE_SIZE};

/// Storage for swapped-out pages: `capacity()` slots of one page each. The engine core
/// never does I/O itself; the mechanism layer provides a file-backed device
/// (`memfold_mem::FileSwapDevice`), tests use [`MemSwapDevice`].
pub trait SwapDevice: Send {
    /// Number of page slots, fixed for the device's life.
    fn capacity(&self) -> u32;
    /// Writes one page to `slot` (< capacity). An error leaves the engine's state unchanged.
    fn write(&mut self, slot: SwapSlot, page: &Page) -> Result<(), String>;
    /// Reads one page from `slot` into `out`. An error leaves the engine's state unchanged.
    fn read(&self, slot: SwapSlot, out: &mut Page) -> Result<(), String>;
}

/// A swap device in memory, for tests and simulations: the same slot semantics as a file,
/// and injectable write/read failures ([`SwapFaults`]).
#[derive(Default)]
pub struct MemSwapDevice {
    slots: Vec<Option<Box<Page>>>,
    faults: SwapFaults,
}

/// Switches that make a [`MemSwapDevice`] fail its writes or reads, kept by a test after the
/// device has moved into an engine.
#[derive(Clone, Default)]
pub struct SwapFaults {
    /// While set, every write fails.
    pub writes: Arc<AtomicBool>,
    /// While set, every read fails.
    pub reads: Arc<AtomicBool>,
}

impl MemSwapDevice {
    /// A device of `slots` pages.
    pub fn new(slots: u32) -> Self {
        MemSwapDevice {
            slots: (0..slots).map(|_| None).collect(),
            faults: SwapFaults::default(),
        }
    }

    /// Handles to this device's failure switches.
    pub fn faults(&self) -> SwapFaults {
        self.faults.clone()
    }
}

impl SwapDevice for MemSwapDevice {
    fn capacity(&self) -> u32 {
        self.slots.len() as u32
    }
    fn write(&mut self, slot: SwapSlot, page: &Page) -> Result<(), String> {
        if self.faults.writes.load(Ordering::Relaxed) {
            return Err(format!("injected write failure at slot {slot}"));
        }
        self.slots[slot as usize] = Some(Box::new(*page));
        Ok(())
    }
    fn read(&self, slot: SwapSlot, out: &mut Page) -> Result<(), String> {
        if self.faults.reads.load(Ordering::Relaxed) {
            return Err(format!("injected read failure at slot {slot}"));
        }
        match &self.slots[slot as usize] {
            Some(p) => {
                out.copy_from_slice(&p[..]);
                Ok(())
            }
            None => Err(format!("slot {slot} was never written")),
        }
    }
}

/// Slot allocation over a [`SwapDevice`]: a bitmap (1 bit a slot) and a rotating hint so
/// that consecutive swap-outs get consecutive slots (sequential I/O).
pub struct SwapSpace {
    dev: Box<dyn SwapDevice>,
    used: Vec<u64>,
    in_use: u32,
    next: u32,
}

/// Swap occupancy, in slots (pages).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SwapStats {
    /// Slots of the device.
    pub capacity: u32,
    /// Slots holding a page.
    pub in_use: u32,
}

impl SwapSpace {
    /// Slot allocation over `dev`.
    pub fn new(dev: Box<dyn SwapDevice>) -> Self {
        let cap = dev.capacity();
        SwapSpace {
            dev,
            used: vec![0; (cap as usize).div_ceil(64)],
            in_use: 0,
            next: 0,
        }
    }

    /// Allocates a slot and writes `page` to it. `Ok(None)` when the device is full (a
    /// normal condition: swap-out is a hint, DE §4.6); `Err` on a device error, with the
    /// slot released again.
    pub fn put(&mut self, page: &Page) -> Result<Option<SwapSlot>, String> {
        let cap = self.dev.capacity();
        if self.in_use == cap {
            return Ok(None);
        }
        let mut s = self.next;
        while self.used[(s / 64) as usize] & (1 << (s % 64)) != 0 {
            s = (s + 1) % cap;
        }
        self.dev.write(s, page)?;
        self.used[(s / 64) as usize] |= 1 << (s % 64);
        self.in_use += 1;
        self.next = (s + 1) % cap;
        Ok(Some(s))
    }

    /// Reads a slot's page without freeing it.
    pub fn get(&self, slot: SwapSlot, out: &mut Page) -> Result<(), String> {
        debug_assert!(self.is_used(slot));
        self.dev.read(slot, out)
    }

    /// Frees a slot.
    pub fn free(&mut self, slot: SwapSlot) {
        debug_assert!(self.is_used(slot));
        self.used[(slot / 64) as usize] &= !(1 << (slot % 64));
        self.in_use -= 1;
    }

    /// Whether a slot holds a page.
    pub fn is_used(&self, slot: SwapSlot) -> bool {
        slot < self.dev.capacity() && self.used[(slot / 64) as usize] & (1 << (slot % 64)) != 0
    }

    /// Occupancy.
    pub fn stats(&self) -> SwapStats {
        SwapStats {
            capacity: self.dev.capacity(),
            in_use: self.in_use,
        }
    }

    /// Bytes of metadata (the bitmap).
    pub fn metadata_bytes(&self) -> usize {
        self.used.capacity() * 8
    }

    /// Bytes of device storage in use.
    pub fn bytes_in_use(&self) -> u64 {
        self.in_use as u64 * PAGE_SIZE as u64
    }
}
