//! The vhost-user side of [`BlkBackend`]: the features and protocol it announces, its
//! config space, the guest memory table QEMU sends, and the kick of each queue (in its own
//! file so that blk.rs holds the requests alone).

use super::*;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use vmm_sys_util::eventfd::EventFd;

impl BlkBackend {
    /// Closes its disk cleanly once no request can come any more (its QEMU has exited):
    /// [`Disk::close_clean`]. Errors: its.
    pub fn close_disk(&mut self) -> Result<(), DiskError> {
        self.disk_mut("close")?.close_clean()
    }

    /// The virtio-blk configuration space (`struct virtio_blk_config` as virtio-bindings
    /// sizes it, 96 bytes; the fields past write-zeroes' are left 0).
    pub fn config_space(&self) -> Vec<u8> {
        let mut c = vec![0u8; std::mem::size_of::<vb::virtio_blk_config>()];
        let put = |c: &mut Vec<u8>, at: usize, b: &[u8]| c[at..at + b.len()].copy_from_slice(b);
        put(&mut c, 0, &(self.disk.size() / SECTOR).to_le_bytes()); // capacity, sectors
        put(&mut c, 8, &SIZE_MAX.to_le_bytes());
        put(&mut c, 12, &SEG_MAX.to_le_bytes());
        // Logical blocks stay 512 bytes (a file system of 1 KiB blocks, as the built
        // images' ext4, does not mount on 4 KiB logical blocks); the topology says 4 KiB
        // physical blocks, so the guest aligns its I/O to pages where it can, and whole
        // aligned pages are what a landed report can name by base block.
        put(&mut c, 20, &(SECTOR as u32).to_le_bytes()); // blk_size
        c[24] = (crate::disk::BLOCK / SECTOR).trailing_zeros() as u8; // physical_block_exp
        put(
            &mut c,
            26,
            &((crate::disk::BLOCK / SECTOR) as u16).to_le_bytes(),
        ); // min_io_size
        put(&mut c, 34, &self.cfg.queues.to_le_bytes());
        if self.disk.can_discard() {
            put(&mut c, 36, &((MAX_DATA / SECTOR) as u32).to_le_bytes()); // max_discard_sectors
            put(&mut c, 40, &MAX_DISCARD_SEG.to_le_bytes());
            put(
                &mut c,
                44,
                &((crate::disk::BLOCK / SECTOR) as u32).to_le_bytes(),
            );
            use std::mem::offset_of;
            use vb::virtio_blk_config as C;
            let sectors = (MAX_DATA / SECTOR) as u32;
            put(
                &mut c,
                offset_of!(C, max_write_zeroes_sectors),
                &sectors.to_le_bytes(),
            );
            put(
                &mut c,
                offset_of!(C, max_write_zeroes_seg),
                &MAX_DISCARD_SEG.to_le_bytes(),
            );
            c[offset_of!(C, write_zeroes_may_unmap)] = 1;
        }
        c
    }
}

impl VhostUserBackendMut for BlkBackend {
    type Bitmap = ();
    type Vring = BlkVring;

    fn num_queues(&self) -> usize {
        self.cfg.queues as usize
    }

    fn max_queue_size(&self) -> usize {
        QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        let bit = |b: u32| 1u64 << b;
        let mut f = F_VERSION_1
            | F_INDIRECT_DESC
            | bit(vb::VIRTIO_BLK_F_SIZE_MAX)
            | bit(vb::VIRTIO_BLK_F_SEG_MAX)
            | bit(vb::VIRTIO_BLK_F_BLK_SIZE)
            | bit(vb::VIRTIO_BLK_F_TOPOLOGY)
            | bit(vb::VIRTIO_BLK_F_FLUSH)
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if self.cfg.queues > 1 {
            f |= bit(vb::VIRTIO_BLK_F_MQ);
        }
        if self.disk.read_only() {
            f |= bit(vb::VIRTIO_BLK_F_RO);
        }
        if self.disk.can_discard() {
            f |= bit(vb::VIRTIO_BLK_F_DISCARD) | bit(vb::VIRTIO_BLK_F_WRITE_ZEROES);
        }
        f
    }

    /// Records whether the driver accepted `VIRTIO_BLK_F_FLUSH` (the request path reads
    /// it: `BlkBackend::write_through`).
    fn acked_features(&mut self, features: u64) {
        self.flush_acked = features & (1 << vb::VIRTIO_BLK_F_FLUSH) != 0;
    }

    /// Back to write-through until the next driver's features are set.
    fn reset_device(&mut self) {
        self.flush_acked = false;
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ
    }

    /// `VIRTIO_RING_F_EVENT_IDX` is not offered: nothing to do.
    fn set_event_idx(&mut self, _enabled: bool) {}

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let c = self.config_space();
        let mut v = vec![0u8; size as usize];
        let from = (offset as usize).min(c.len());
        let to = (offset as usize).saturating_add(size as usize).min(c.len());
        v[..to - from].copy_from_slice(&c[from..to]);
        v
    }

    /// vhost-user-backend has just mapped QEMU's memory table (`mem`): **that mapping is
    /// never used** (see [`crate::mem`]). From it only each region's guest address, length
    /// and file are read; QEMU (the socket's peer, checked against `--qemu-pid`) and its
    /// address of each region are found, and guest RAM is reached through them from now
    /// on.
    fn update_memory(&mut self, mem: Gm) -> io::Result<()> {
        // vhost-user-backend has switched to the new table already: a table refused below
        // leaves the device with none (requests wait), never the old one's addresses.
        self.mem = None;
        let qemu = remote::peer_on_socket(&self.cfg.socket).map_err(io::Error::other)?;
        if let Some(expected) = self.cfg.expected_qemu {
            if qemu.pid() != expected {
                let e = RemoteError::WrongPeer {
                    peer: qemu.pid(),
                    expected,
                };
                tracing::error!("{e}");
                return Err(io::Error::other(e));
            }
        }
        let snapshot = mem.memory();
        let r = RemoteMemory::from_mmap(Arc::new(qemu), &*snapshot).map_err(io::Error::other)?;
        tracing::info!(
            "guest RAM of QEMU pid {}: {} regions ({} MiB); {}",
            r.qemu().pid(),
            r.regions().len(),
            r.regions().iter().map(|x| x.len).sum::<u64>() >> 20,
            if r.qemu().fenced() {
                "writes held in its agent's write fence"
            } else {
                "no memfold agent (no write fence)"
            }
        );
        self.mem = Some(Arc::new(r));
        Ok(())
    }

    /// A new exit event for worker thread `thread_index` of a new daemon (the binary
    /// makes one per connection), both its descriptors close-on-exec.
    ///
    /// vhost-user-backend 0.24 (`VringEpollHandler::new`) registers the consumer's
    /// descriptor with its epoll by `into_raw_fd` and never closes it: one descriptor lost
    /// per connection, so a peer that connects and closes in a loop would run the process
    /// out of them. The device closes it itself, when it hands out the next one for that
    /// thread (and at its drop). Sound because the loop never uses that descriptor again
    /// after registering it (it reads no exit event, and removes no registration), and
    /// the registration lives on without it: epoll keys it on the eventfd, which the
    /// notifier the loop keeps holds open — so even a loop still running loses nothing.
    /// It assumes the daemons of one device are made one at a time (the binary serves one
    /// connection at a time), so that the previous one has registered its descriptor.
    fn exit_event(&self, thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        let efd = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).ok()?;
        // SAFETY: `into_raw_fd` hands over the eventfd's descriptor, owned by nothing else.
        let consumer = unsafe { OwnedFd::from_raw_fd(efd.into_raw_fd()) };
        // `F_DUPFD_CLOEXEC`: the same eventfd, close-on-exec too.
        let notifier = consumer.try_clone().ok()?;
        let mut handed = self.exit_events.lock().unwrap_or_else(|p| p.into_inner());
        if handed.len() <= thread_index {
            handed.resize(thread_index + 1, None);
        }
        if let Some(old) = handed[thread_index].replace(consumer.as_raw_fd()) {
            // SAFETY: the descriptor handed out for this thread before, which
            // vhost-user-backend let go of (see above) and nothing else closes.
            drop(unsafe { OwnedFd::from_raw_fd(old) });
        }
        // SAFETY: each takes over a descriptor it alone owns.
        Some(unsafe {
            (
                EventConsumer::from_raw_fd(consumer.into_raw_fd()),
                EventNotifier::from_raw_fd(notifier.into_raw_fd()),
            )
        })
    }

    fn handle_event(
        &mut self,
        device_event: u16,
        evset: EventSet,
        vrings: &[BlkVring],
        _thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Ok(());
        }
        let Some(vring) = vrings.get(device_event as usize) else {
            tracing::warn!("event for queue {device_event} of {}", vrings.len());
            return Ok(());
        };
        let Some(mem) = self.mem.clone() else {
            tracing::warn!("queue {device_event} kicked before any memory table");
            return Ok(());
        };
        if !vring.get_ref().get_queue().ready() {
            // Broken by a request (logged then) or stopped: left until started again,
            // its used index's stale mark kept for then.
            return Ok(());
        }
        let stale = vring.take_used_stale();
        let served = {
            let mut state = vring.get_mut();
            self.process_queue(state.get_queue_mut(), &mem, stale)
        };
        match served {
            Ok(served) => {
                if served.pending {
                    kick_again(vring, device_event);
                }
                if served.notify {
                    vring.signal_used_queue()?;
                }
            }
            Err(e) => {
                tracing::error!("queue {device_event}: {e}");
                if stale {
                    // Read it again at the next kick.
                    vring.queue_used_idx().ok();
                }
                if e.notify {
                    // Requests completed before the failure.
                    vring.signal_used_queue()?;
                }
            }
        }
        Ok(())
    }
}

/// Kicks `vring` as its guest does, so that vhost-user-backend's loop comes back to the
/// requests a bounded [`BlkBackend::process_queue`] left, after it has let the backend's
/// lock go (the guest has kicked for them already and will not again).
fn kick_again(vring: &BlkVring, queue: u16) {
    let state = vring.get_ref();
    let Some(kick) = state.get_kick() else {
        tracing::error!("queue {queue}: requests left and no kick to come back to them");
        return;
    };
    let r = kick.try_clone().and_then(|k| {
        // SAFETY: `k` owns a duplicate of the kick eventfd; the notifier takes it over
        // and closes it.
        let n = unsafe { EventNotifier::from_raw_fd(k.into_raw_fd()) };
        n.notify()
    });
    if let Err(e) = r {
        tracing::error!("queue {queue}: requests left, the queue's kick failed: {e}");
    }
}

impl Drop for BlkBackend {
    /// Closes the exit events' descriptors vhost-user-backend let go of (see
    /// `BlkBackend::exit_event`): every daemon holds the device, so none is left.
    fn drop(&mut self) {
        let handed = self
            .exit_events
            .get_mut()
            .unwrap_or_else(|p| p.into_inner());
        for fd in handed.drain(..).flatten() {
            // SAFETY: handed out by `exit_event`, let go of by vhost-user-backend, closed
            // by nothing else.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
}
