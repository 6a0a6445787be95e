//! The vhost-user side of [`BlkBackend`]: the features and protocol it announces, its
//! config space, the guest memory table QEMU sends, and the kick of each queue (in its own
//! file so that blk.rs holds the requests alone).

use super::*;
use std::os::fd::{FromRawFd, IntoRawFd};

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
            f |= bit(vb::VIRTIO_BLK_F_DISCARD);
        }
        f
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

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
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
