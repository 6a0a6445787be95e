//! The vring type handed to vhost-user-backend: its `VringRwLock` with every method that
//! would reach guest RAM through the crate's mapping taken away (see [`crate::mem`]).
//!
//! vhost-user-backend calls one such method itself: `queue_used_idx` in its
//! `SET_VRING_ADDR` handler, to start the used index where the ring says. Here it reads
//! nothing: it marks the vring's used index stale and answers the index the queue
//! already has, and the device reads the ring's used index through QEMU
//! ([`BlkVring::take_used_stale`]) before it touches the queue again. The other
//! memory-touching methods (`add_used`, `enable_notification`, `disable_notification`,
//! `needs_notification`) are called by no one but a backend; here they refuse with an
//! error and a log line, and the device calls virtio-queue's `Queue` methods with a
//! [`crate::mem::RemoteView`] instead.

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLockReadGuard, RwLockWriteGuard};

use vhost_user_backend::{VringRwLock, VringState, VringStateGuard, VringStateMutGuard, VringT};
use virtio_queue::Error as VirtQueError;
use vm_memory::{GuestMemoryAtomic, GuestMemoryError, GuestMemoryMmap};

/// The memory type vhost-user-backend builds (never read or written here).
pub type Gm = GuestMemoryAtomic<GuestMemoryMmap<()>>;

/// A vring whose guest-memory methods do not use the crate's mapping.
#[derive(Clone)]
pub struct BlkVring {
    inner: VringRwLock<Gm>,
    used_stale: Arc<AtomicBool>,
}

impl BlkVring {
    /// Whether the ring's used index must be read (through QEMU) before the queue is used
    /// again; clears the mark.
    pub fn take_used_stale(&self) -> bool {
        self.used_stale.swap(false, Ordering::AcqRel)
    }

    fn refuse(what: &str) -> VirtQueError {
        tracing::error!("vring: {what} through vhost-user-backend's mapping of guest RAM refused (the device uses QEMU's page tables)");
        VirtQueError::GuestMemory(GuestMemoryError::HostAddressNotAvailable)
    }
}

impl<'a> VringStateGuard<'a, Gm> for BlkVring {
    type G = RwLockReadGuard<'a, VringState<Gm>>;
}

impl<'a> VringStateMutGuard<'a, Gm> for BlkVring {
    type G = RwLockWriteGuard<'a, VringState<Gm>>;
}

impl VringT<Gm> for BlkVring {
    fn new(mem: Gm, max_queue_size: u16) -> Result<Self, VirtQueError> {
        Ok(BlkVring {
            inner: VringRwLock::new(mem, max_queue_size)?,
            used_stale: Arc::new(AtomicBool::new(false)),
        })
    }
    fn get_ref(&self) -> RwLockReadGuard<'_, VringState<Gm>> {
        self.inner.get_ref()
    }
    fn get_mut(&self) -> RwLockWriteGuard<'_, VringState<Gm>> {
        self.inner.get_mut()
    }
    fn add_used(&self, _desc_index: u16, _len: u32) -> Result<(), VirtQueError> {
        Err(Self::refuse("add_used"))
    }
    fn signal_used_queue(&self) -> io::Result<()> {
        self.inner.signal_used_queue()
    }
    fn enable_notification(&self) -> Result<bool, VirtQueError> {
        Err(Self::refuse("enable_notification"))
    }
    fn disable_notification(&self) -> Result<(), VirtQueError> {
        Err(Self::refuse("disable_notification"))
    }
    fn needs_notification(&self) -> Result<bool, VirtQueError> {
        Err(Self::refuse("needs_notification"))
    }
    fn set_enabled(&self, enabled: bool) {
        self.inner.set_enabled(enabled)
    }
    fn set_queue_info(
        &self,
        desc_table: u64,
        avail_ring: u64,
        used_ring: u64,
    ) -> Result<(), VirtQueError> {
        self.inner.set_queue_info(desc_table, avail_ring, used_ring)
    }
    fn queue_next_avail(&self) -> u16 {
        self.inner.queue_next_avail()
    }
    fn set_queue_next_avail(&self, base: u16) {
        self.inner.set_queue_next_avail(base)
    }
    fn set_queue_next_used(&self, idx: u16) {
        self.inner.set_queue_next_used(idx)
    }
    /// Reads nothing: marks the used index stale (see the module's doc) and answers the
    /// queue's own next used index, which the caller then sets unchanged.
    fn queue_used_idx(&self) -> Result<u16, VirtQueError> {
        self.used_stale.store(true, Ordering::Release);
        use virtio_queue::QueueT;
        Ok(self.inner.get_ref().get_queue().next_used())
    }
    fn set_queue_size(&self, num: u16) {
        self.inner.set_queue_size(num)
    }
    fn set_queue_event_idx(&self, enabled: bool) {
        self.inner.set_queue_event_idx(enabled)
    }
    fn set_queue_ready(&self, ready: bool) {
        self.inner.set_queue_ready(ready)
    }
    fn set_kick(&self, file: Option<File>) {
        self.inner.set_kick(file)
    }
    fn read_kick(&self) -> io::Result<bool> {
        self.inner.read_kick()
    }
    fn set_call(&self, file: Option<File>) {
        self.inner.set_call(file)
    }
    fn set_err(&self, file: Option<File>) {
        self.inner.set_err(file)
    }
}
