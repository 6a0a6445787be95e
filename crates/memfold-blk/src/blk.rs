//! The virtio-blk device on vhost-user-backend: requests read, write, flush, discard and
//! get-id over a [`Disk`], guest RAM reached only through QEMU ([`crate::mem`]), every
//! read reported to a [`LandedSink`].
//!
//! A malformed request — a header that is short, a sector range past the disk's end, a
//! data buffer that is not whole sectors, larger than the device announces or wrapping
//! the address space — is answered with `VIRTIO_BLK_S_IOERR` in its status byte. A
//! request whose status byte is not known or cannot be written — its descriptors
//! unreadable, a chain longer than `seg_max` allows (read no further: its end, where the
//! status byte is, never reached), a readable descriptor after a writable one, no
//! writable byte, a status byte outside guest RAM — is not completed at all: completed
//! with nothing written, the guest would read whatever its status byte held before
//! (Linux reuses the area: usually the previous request's OK), and a dropped write would
//! look done. Its queue is broken instead, as QEMU's `virtio_error` does: one log line,
//! and no request of it is served until vhost-user-backend marks it ready again: at the
//! ring's start after the driver resets the device (`GET_VRING_BASE`, `SET_VRING_KICK`),
//! but also at a `SET_VRING_CALL` (QEMU sends one when the guest masks or unmasks the
//! queue's vector), after which the queue is served again and the guest's next such
//! chain breaks it again: never completed as if served, either way. An honest driver never
//! sends such a chain. The device never panics on guest input and writes only inside the
//! buffers the guest gave it (each write is to a device-writable descriptor's range,
//! checked against guest RAM by [`RemoteMemory`]).

use std::io;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackendMut, VringT};
use virtio_bindings::virtio_blk as vb;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestAddressSpace;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{EventConsumer, EventNotifier};

use crate::disk::{Disk, DiskError, SECTOR};
use crate::landed::LandedSink;
use crate::mem::{MemError, RemoteMemory};
use crate::remote::{self, RemoteError};
use crate::vring::{BlkVring, Gm};

pub use counters::Counters;

/// `VIRTIO_F_VERSION_1`.
const F_VERSION_1: u64 = 1 << 32;
/// `VIRTIO_RING_F_INDIRECT_DESC`.
const F_INDIRECT_DESC: u64 = 1 << 28;
/// Longest queue, descriptors.
pub const QUEUE_SIZE: usize = 256;
/// Largest data segment announced (`size_max`), bytes.
pub const SIZE_MAX: u32 = 256 << 10;
/// Most data segments per request announced (`seg_max`): QEMU's, its default queue of
/// 128 less header and status.
pub const SEG_MAX: u32 = 126;
/// Most descriptors a request's chain may have: `SEG_MAX` data segments, the header and
/// the status. Linux's virtio_blk sets its queue's `max_segments` to `seg_max` and adds
/// one descriptor each for header and status, so an honest chain is never longer; a
/// longer one is not read past this (an indirect table may claim 65 535).
const MAX_CHAIN: usize = SEG_MAX as usize + 2;
/// Largest request data accepted, bytes (`SIZE_MAX · SEG_MAX`).
pub const MAX_DATA: u64 = SIZE_MAX as u64 * SEG_MAX as u64;
/// Most discard ranges per request announced.
pub const MAX_DISCARD_SEG: u32 = 16;
/// Request header, bytes: type u32, reserved u32, sector u64.
const HEADER: u64 = 16;

/// What the device is configured with.
#[derive(Clone, Debug)]
pub struct BlkConfig {
    /// The vhost-user socket memfold-blk listens on (QEMU connects to it).
    pub socket: PathBuf,
    /// The serial get-id answers (at most 20 bytes are sent).
    pub serial: String,
    /// Queues offered (QEMU's `num-queues` may use fewer).
    pub queues: u16,
    /// The QEMU expected on the socket (`--qemu-pid`): a connection from any other process
    /// is refused.
    pub expected_qemu: Option<u32>,
    /// Reads are served at most this fast, bytes/s (a slow disk, as QEMU's `bps_rd`: the
    /// queue waits before a read that would exceed it); `None`: as fast as the disk.
    pub read_bytes_per_sec: Option<u64>,
}

/// The device: a disk, the guest's RAM (once QEMU sends its memory table), a sink.
pub struct BlkBackend {
    cfg: BlkConfig,
    /// Shared only with the read-ahead thread, for one read at a time (`ahead.rs`).
    disk: Arc<dyn Disk>,
    sink: Box<dyn LandedSink>,
    mem: Option<Arc<RemoteMemory>>,
    counters: Counters,
    /// With a read rate: when the disk is free for the next read.
    read_free_at: std::time::Instant,
    /// The buffers disk reads land in, reused from request to request (`read.rs`), and
    /// the next request's disk read while this one's bytes are copied (`ahead.rs`).
    ahead: ahead::ReadAhead,
    /// Whether the driver accepted `VIRTIO_BLK_F_FLUSH` (set at `SET_FEATURES`): only
    /// then may a completed write wait in the disk's cache for the guest's flush. Off
    /// until the features are set, and after a reset: each write is then durable before
    /// it completes (`BlkBackend::write_through`).
    flush_acked: bool,
    /// Holds fills off after one memfoldd did not answer ([`fill::FILL_BACKOFF`]).
    fill_backoff: fill::Backoff,
    /// Exit events handed to vhost-user-backend for each worker thread, closed when
    /// replaced (see `BlkBackend::exit_event`).
    exit_events: std::sync::Mutex<Vec<Option<std::os::fd::RawFd>>>,
    /// The most bytes of bounce buffers a pass's view held at once.
    #[cfg(test)]
    peak_bounce_bytes: u64,
}

/// What one [`BlkBackend::process_queue`] call did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Served {
    /// The guest must be notified of used buffers.
    pub notify: bool,
    /// Requests are still available: the call stopped at its bound and must be made
    /// again (no kick of the guest's will come for them).
    pub pending: bool,
}

/// A [`BlkBackend::process_queue`] call that failed on the rings, and whether requests
/// it completed before the failure want the guest notified (they are in the used ring:
/// unnotified, the guest may wait on them for good).
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct QueueFailed {
    /// Why the rings could not be read or written.
    pub error: MemError,
    /// The guest must be notified of used buffers all the same.
    pub notify: bool,
}

impl From<MemError> for QueueFailed {
    /// A failure before any request was completed: nothing to notify.
    fn from(error: MemError) -> QueueFailed {
        QueueFailed {
            error,
            notify: false,
        }
    }
}

/// Why a request failed, for the log.
#[derive(Debug, thiserror::Error)]
enum ReqError {
    #[error("{0}")]
    Malformed(String),
    #[error(transparent)]
    Mem(#[from] MemError),
    #[error(transparent)]
    Disk(#[from] DiskError),
    /// Well formed, but asks what the device does not do: answered UNSUPP.
    #[error("{0}")]
    Unsupported(String),
}

/// A request's device-readable and device-writable bytes, as guest-physical runs.
struct Chain {
    head: u16,
    readable: Vec<(u64, u64)>,
    writable: Vec<(u64, u64)>,
}

impl Chain {
    fn readable_len(&self) -> u64 {
        self.readable.iter().map(|r| r.1).sum()
    }
    fn writable_len(&self) -> u64 {
        self.writable.iter().map(|r| r.1).sum()
    }
}

/// The runs `[from, from + len)` of a stream made of `runs`.
fn sub_runs(runs: &[(u64, u64)], from: u64, len: u64) -> Vec<(u64, u64)> {
    let mut v = Vec::new();
    let (mut skip, mut left) = (from, len);
    for &(a, n) in runs {
        if left == 0 {
            break;
        }
        if skip >= n {
            skip -= n;
            continue;
        }
        let take = (n - skip).min(left);
        v.push((a + skip, take));
        left -= take;
        skip = 0;
    }
    v
}

/// Reads bytes `[from, from + len)` of the stream `runs` from guest RAM.
fn gather(
    mem: &RemoteMemory,
    runs: &[(u64, u64)],
    from: u64,
    len: u64,
) -> Result<Vec<u8>, MemError> {
    let mut buf = vec![0u8; len as usize];
    let mut parts: Vec<(u64, &mut [u8])> = Vec::new();
    let mut rest: &mut [u8] = &mut buf;
    for (a, n) in sub_runs(runs, from, len) {
        let (p, r) = rest.split_at_mut(n as usize);
        parts.push((a, p));
        rest = r;
    }
    mem.read_runs(&mut parts)?;
    Ok(buf)
}

impl BlkBackend {
    /// The device for `disk`, reporting reads to `sink`.
    pub fn new(cfg: BlkConfig, disk: Box<dyn Disk>, sink: Box<dyn LandedSink>) -> BlkBackend {
        // A read rate holds each read to its turn (`throttle_read`): none ahead.
        let ahead = ahead::ReadAhead::new(cfg.read_bytes_per_sec.is_some());
        BlkBackend {
            cfg,
            disk: Arc::from(disk),
            sink,
            mem: None,
            counters: Counters::default(),
            read_free_at: std::time::Instant::now(),
            ahead,
            flush_acked: false,
            fill_backoff: Default::default(),
            exit_events: Default::default(),
            #[cfg(test)]
            peak_bounce_bytes: 0,
        }
    }

    /// Waits for `len` bytes of read budget under [`BlkConfig::read_bytes_per_sec`]: the
    /// read starts when the disk is free and keeps it busy `len / rate` seconds.
    fn throttle_read(&mut self, len: u64) {
        let Some(rate) = self.cfg.read_bytes_per_sec.filter(|&r| r > 0) else {
            return;
        };
        let now = std::time::Instant::now();
        let start = self.read_free_at.max(now);
        std::thread::sleep(start - now);
        self.read_free_at = start + std::time::Duration::from_secs_f64(len as f64 / rate as f64);
    }

    /// Requests so far.
    pub fn counters(&self) -> Counters {
        Counters {
            read_ahead_dropped: self.ahead.dropped,
            disk_read_bytes: self.counters.disk_read_bytes + self.ahead.read_bytes,
            ..self.counters
        }
    }

    /// The sink (tests read a counting sink back).
    pub fn sink(&self) -> &dyn LandedSink {
        self.sink.as_ref()
    }

    /// Installs guest RAM directly (tests drive queues without vhost-user), or forgets
    /// it (`None`: QEMU disconnected — and the driver's features with it: writes are
    /// synced until the next peer accepts FLUSH).
    pub fn set_memory(&mut self, mem: Option<Arc<RemoteMemory>>) {
        if mem.is_none() {
            self.flush_acked = false;
        }
        self.mem = mem;
    }

    /// Processes the available requests of `queue`, at most the queue's size of them;
    /// returns whether the guest must be notified and whether requests are left. Guest RAM
    /// is reached through `mem` only. `used_stale`: the ring (re)started; its used index is
    /// read first and the guest notified whatever is served (a device killed between an
    /// `add_used` and its signal left the request unseen; Linux's virtio-blk never times out).
    ///
    /// The bound lets a guest that keeps the ring busy hold the device's thread (and the
    /// backend's lock, which vhost-user's control messages need) one call at a time, not
    /// for good: the caller must call again while [`Served::pending`]. Each request reads
    /// at most `MAX_CHAIN` + 1 descriptors, so a call's work is bounded too.
    ///
    /// A queue that is not ready is left alone: a request without a usable status byte
    /// marks its queue not ready (broken, see the module's doc) until vhost-user-backend
    /// starts the ring again (`SET_VRING_KICK`, after QEMU's reset of the device).
    ///
    /// Errors: the rings themselves cannot be read or written (QEMU gone, rings outside
    /// guest RAM); [`QueueFailed::notify`] says whether requests completed before that
    /// still want the guest notified.
    pub fn process_queue(
        &mut self,
        queue: &mut Queue,
        mem: &RemoteMemory,
        used_stale: bool,
    ) -> Result<Served, QueueFailed> {
        if !queue.ready() {
            return Ok(Served::default());
        }
        let view = mem.view();
        if used_stale {
            let used = queue
                .used_idx(&view, Ordering::Acquire)
                .map_err(|e| queue_error(&view, e))?;
            queue.set_next_used(used.0);
            // After a reconnect QEMU starts the ring at its used index: what waits beyond
            // it (a dead device's unfinished requests among them) is served now, in order.
            let avail = queue
                .avail_idx(&view, Ordering::Acquire)
                .map_err(|e| queue_error(&view, e))?;
            tracing::info!(
                "queue starts at ring index {} (used index {}): {} requests waiting",
                queue.next_avail(),
                used.0,
                avail.0.wrapping_sub(queue.next_avail())
            );
        }
        self.counters.ring_reads += view.remote_reads();
        drop(view);
        let mut any = false;
        let mut budget = queue.size();
        let pending = loop {
            let mut view = mem.view();
            let more = self.serve_pass(queue, mem, &mut view, &mut any, &mut budget);
            self.counters.ring_reads += view.remote_reads();
            #[cfg(test)]
            {
                self.peak_bounce_bytes = self.peak_bounce_bytes.max(view.peak_bounce_bytes());
            }
            let more = match more {
                Ok(more) => more,
                Err(error) => {
                    // Requests served before the failure are in the used ring: the guest
                    // must hear of them (an interrupt too many costs it nothing).
                    let notify =
                        used_stale || any && self.needs_notification(queue, mem).unwrap_or(true);
                    return Err(QueueFailed { error, notify });
                }
            };
            match more {
                false => break false,
                // Left for the next call (the caller's to make: the backend kicks the
                // queue again once it has let its lock go).
                true if budget == 0 => break true,
                true => {}
            }
        };
        if !any || used_stale {
            return Ok(Served {
                notify: used_stale,
                pending,
            });
        }
        let notify = self
            .needs_notification(queue, mem)
            .map_err(|error| QueueFailed {
                error,
                notify: true,
            })?;
        Ok(Served { notify, pending })
    }

    /// Whether the guest wants a notification of the used buffers added (virtio 1.1
    /// §2.6.7.2).
    ///
    /// Errors: the ring's `used_event` cannot be read.
    fn needs_notification(
        &mut self,
        queue: &mut Queue,
        mem: &RemoteMemory,
    ) -> Result<bool, MemError> {
        let view = mem.view();
        let notify = queue
            .needs_notification(&view)
            .map_err(|e| queue_error(&view, e));
        self.counters.ring_reads += view.remote_reads();
        notify
    }

    /// Serves the requests available now, at most `budget` of them (each served takes
    /// one off it); returns whether more are waiting (the notification check of virtio
    /// 1.1 §2.6.7.2), `false` once a request broke the queue. `any` is set if one was
    /// served. Each request's bounce buffers are
    /// freed once it is answered ([`crate::mem::RemoteView::release`]).
    ///
    /// Errors: the rings cannot be read or written, or the guest's available index runs
    /// more than the queue's size ahead of the device's (virtio 1.1 §2.6.6: it may not).
    /// Checked here rather than left to virtio-queue, whose `pop_descriptor_chain` logs
    /// either and returns `None`, which `enable_notification` then takes for more to do:
    /// a guest spun the device's thread for good, its bounce buffers piling up.
    fn serve_pass(
        &mut self,
        queue: &mut Queue,
        mem: &RemoteMemory,
        view: &mut crate::mem::RemoteView<'_>,
        any: &mut bool,
        budget: &mut u16,
    ) -> Result<bool, MemError> {
        queue
            .disable_notification(&*view)
            .map_err(|e| queue_error(view, e))?;
        while *budget > 0 {
            // Shared for the request, mutable again to release its buffers.
            let view_mut = &mut *view;
            let view = &*view_mut;
            let avail = queue
                .avail_idx(view, Ordering::Acquire)
                .map_err(|e| queue_error(view, e))?;
            let waiting = avail.0.wrapping_sub(queue.next_avail());
            if waiting == 0 {
                // While the guest takes what was served: a sequential stream's next
                // range, read ahead (`ahead.rs`).
                self.ahead.guess(&self.disk);
                break;
            }
            if waiting > queue.size() {
                return Err(MemError::Queue(format!(
                    "available index {} is {waiting} requests past the device's {}, more \
                     than the queue's {}",
                    avail.0,
                    queue.next_avail(),
                    queue.size()
                )));
            }
            let Some(chain) = queue.pop_descriptor_chain(view) else {
                return Err(view.take_error().unwrap_or_else(|| {
                    MemError::Queue(format!(
                        "entry {} of the available ring cannot be read",
                        queue.next_avail()
                    ))
                }));
            };
            let head = chain.head_index();
            let mut c = Chain {
                head,
                readable: Vec::new(),
                writable: Vec::new(),
            };
            let mut order_ok = true;
            let (mut wraps, mut too_long) = (false, false);
            view.reading_descriptors(true);
            for (i, d) in chain.enumerate() {
                if i == MAX_CHAIN {
                    too_long = true;
                    break;
                }
                if d.len() == 0 {
                    continue;
                }
                let (addr, len) = (d.addr().0, d.len() as u64);
                // A buffer that runs past the end of the address space: nothing of the
                // request is served, not even its status byte (at `addr + len - 1`).
                wraps |= addr.checked_add(len).is_none();
                if d.is_write_only() {
                    c.writable.push((addr, len));
                } else if c.writable.is_empty() {
                    c.readable.push((addr, len));
                } else {
                    order_ok = false;
                }
            }
            view.reading_descriptors(false);
            // Err: where its status byte is, is not known (the chain's layout is broken).
            let used = if let Some(e) = view.take_error() {
                Err(format!("its descriptors could not be read: {e}"))
            } else if too_long {
                Err(format!(
                    "over {MAX_CHAIN} descriptors (seg_max): its end, the status byte, not read"
                ))
            } else if !order_ok {
                Err("a device-readable descriptor after a writable one".into())
            } else if wraps {
                // Its status byte, if addressable, gets IOERR; the rest is not touched.
                let e = ReqError::Malformed("a buffer wraps the address space".into());
                self.finish(mem, &c, Err(e), 0)
            } else {
                // The next request's disk read may run while this one's bytes are
                // copied (`ahead.rs`): worth a look only after a large read.
                self.ahead.next =
                    (self.ahead.on() && *budget > 1 && c.writable_len() > ahead::AHEAD_MIN)
                        .then(|| ahead::peek_read(queue, mem, view, self.disk.size()))
                        .flatten();
                self.request(mem, &c)
            };
            let used = match used {
                Ok(n) => n,
                Err(why) => {
                    self.break_queue(queue, head, &why);
                    // Notifications stay off: a broken queue wants no kicks.
                    return Ok(false);
                }
            };
            queue
                .add_used(view, head, used)
                .map_err(|e| queue_error(view, e))?;
            if let Some(e) = view.take_error() {
                return Err(e);
            }
            *any = true;
            *budget -= 1;
            // Answered: no slice of the request is left (`release` takes the view
            // mutably), so its bounce buffers go now, not at the end of the pass.
            view_mut.release();
        }
        queue
            .enable_notification(&*view)
            .map_err(|e| queue_error(view, e))
    }

    /// Marks `queue` broken by request `head` (see the module's doc): not ready, so not
    /// served until vhost-user-backend starts it again; logged once, here.
    fn break_queue(&mut self, queue: &mut Queue, head: u16, why: &str) {
        self.counters.dropped += 1;
        queue.set_ready(false);
        tracing::error!(
            "request {head}: {why}; not completed (no status byte to answer it in), and its queue is served no more until the driver resets the device"
        );
    }

    /// Serves one request; returns the bytes written into its writable buffers, or why
    /// no status byte could be written (the queue is then broken).
    fn request(&mut self, mem: &RemoteMemory, c: &Chain) -> Result<u32, String> {
        if c.readable_len() < HEADER {
            return self.finish(
                mem,
                c,
                Err(ReqError::Malformed(format!(
                    "header of {} bytes",
                    c.readable_len()
                ))),
                0,
            );
        }
        let h = match gather(mem, &c.readable, 0, HEADER) {
            Ok(h) => h,
            Err(e) => return self.finish(mem, c, Err(e.into()), 0),
        };
        let kind = u32::from_le_bytes(h[0..4].try_into().expect("4 bytes"));
        let sector = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
        if c.writable_len() == 0 {
            return self.finish(mem, c, Err(ReqError::Malformed("no status byte".into())), 0);
        }
        let in_len = c.writable_len() - 1;
        let out_len = c.readable_len() - HEADER;
        if kind != vb::VIRTIO_BLK_T_IN {
            // No bytes read before a write or discard may serve a read after it.
            self.ahead.drop_pending();
        }
        match kind {
            vb::VIRTIO_BLK_T_IN => {
                let r = self.read(mem, c, sector, in_len);
                let n = if r.is_ok() { in_len as u32 } else { 0 };
                if r.is_ok() {
                    self.counters.reads += 1;
                    self.counters.read_bytes += in_len;
                }
                self.finish(mem, c, r, n)
            }
            vb::VIRTIO_BLK_T_OUT => {
                let r = self.write(mem, c, sector, out_len);
                if r.is_ok() {
                    self.counters.writes += 1;
                }
                self.finish(mem, c, r, 0)
            }
            vb::VIRTIO_BLK_T_FLUSH => {
                let r = self.disk.flush().map_err(ReqError::from);
                self.counters.flushes += 1;
                self.finish(mem, c, r, 0)
            }
            vb::VIRTIO_BLK_T_GET_ID => {
                let mut id = [0u8; vb::VIRTIO_BLK_ID_BYTES as usize];
                let s = self.cfg.serial.as_bytes();
                let k = s.len().min(id.len());
                id[..k].copy_from_slice(&s[..k]);
                let n = in_len.min(id.len() as u64);
                let r = self.put(mem, &sub_runs(&c.writable, 0, n), &id[..n as usize]);
                self.finish(mem, c, r, n as u32)
            }
            vb::VIRTIO_BLK_T_DISCARD if self.disk.can_discard() => {
                let r = self.discard(mem, c, out_len, RangeOp::Discard);
                if r.is_ok() {
                    self.counters.discards += 1;
                }
                self.finish(mem, c, r, 0)
            }
            vb::VIRTIO_BLK_T_WRITE_ZEROES if self.disk.can_discard() => {
                let r = self.discard(mem, c, out_len, RangeOp::Zeroes);
                if r.is_ok() {
                    self.counters.write_zeroes += 1;
                }
                self.finish(mem, c, r, 0)
            }
            other => {
                self.counters.unsupported += 1;
                tracing::debug!("request {}: type {other} unsupported", c.head);
                self.status(mem, c, vb::VIRTIO_BLK_S_UNSUPP as u8, 0)
            }
        }
    }

    /// Checks that `len` data bytes at `sector` are whole sectors within the disk and
    /// within what the device accepts; returns the disk byte offset.
    fn data_range(&self, sector: u64, len: u64) -> Result<u64, ReqError> {
        if len % SECTOR != 0 || len > MAX_DATA {
            return Err(ReqError::Malformed(format!(
                "{len} data bytes (whole sectors up to {MAX_DATA} expected)"
            )));
        }
        let off = sector
            .checked_mul(SECTOR)
            .filter(|o| o.checked_add(len).is_some_and(|e| e <= self.disk.size()))
            .ok_or_else(|| {
                ReqError::Malformed(format!(
                    "sectors {sector}+{} past the disk's end",
                    len / SECTOR
                ))
            })?;
        Ok(off)
    }

    fn write(
        &mut self,
        mem: &RemoteMemory,
        c: &Chain,
        sector: u64,
        len: u64,
    ) -> Result<(), ReqError> {
        if self.disk.read_only() {
            return Err(ReqError::Disk(DiskError::ReadOnly {
                path: self.cfg.socket.clone(),
            }));
        }
        let off = self.data_range(sector, len)?;
        let buf = gather(mem, &c.readable, HEADER, len)?;
        self.disk.write(off, &buf)?;
        self.write_through()
    }

    /// The disk to itself, for a discard or the close: once no read ahead is under way,
    /// the reader thread holds no reference to it (`ahead.rs`).
    ///
    /// Errors: [`DiskError::Io`] if another reference is held all the same (a defect:
    /// the operation is refused rather than run beside a read).
    fn disk_mut(&mut self, op: &'static str) -> Result<&mut (dyn Disk + 'static), DiskError> {
        self.ahead.drop_pending();
        let path = self.cfg.socket.clone();
        Arc::get_mut(&mut self.disk).ok_or_else(|| DiskError::Io {
            path,
            op,
            off: 0,
            len: 0,
            source: io::Error::other("the disk is still held by the read-ahead thread"),
        })
    }

    /// Makes a completed write or discard durable when the driver did not accept
    /// `VIRTIO_BLK_F_FLUSH`: such a driver (SeaBIOS's, some bootloaders') sends no flush
    /// and takes a write-through cache (Linux's `virtblk_get_cache_mode` too; QEMU's own
    /// virtio-blk turns its cache write-through then), so an OK must mean on disk. The
    /// sync is a guest flush's ([`Disk::flush`]: its failure latch included). With the
    /// feature accepted, one branch and nothing more.
    ///
    /// Errors: the sync's ([`DiskError::Io`]): the request gets IOERR.
    fn write_through(&self) -> Result<(), ReqError> {
        if self.flush_acked {
            return Ok(());
        }
        self.disk.flush()?;
        Ok(())
    }

    /// Writes the status of a request that ended with `r` (OK with `n` data bytes written,
    /// or IOERR); returns the used length, or why no status byte could be written.
    fn finish(
        &mut self,
        mem: &RemoteMemory,
        c: &Chain,
        r: Result<(), ReqError>,
        n: u32,
    ) -> Result<u32, String> {
        match r {
            Ok(()) => self.status(mem, c, vb::VIRTIO_BLK_S_OK as u8, n),
            Err(ReqError::Unsupported(why)) => {
                self.counters.unsupported += 1;
                tracing::debug!("request {}: {why}: unsupported", c.head);
                self.status(mem, c, vb::VIRTIO_BLK_S_UNSUPP as u8, 0)
            }
            Err(e) => {
                let used = self
                    .status(mem, c, vb::VIRTIO_BLK_S_IOERR as u8, 0)
                    .map_err(|why| format!("{e}; {why}"))?;
                tracing::warn!("request {}: {e}", c.head);
                self.counters.io_errors += 1;
                Ok(used)
            }
        }
    }

    /// Writes status byte `s` (the last writable byte) and returns the used length
    /// (`n` data bytes and the status byte); or why it could not: no writable byte, or a
    /// status byte past the address space or not written.
    fn status(&mut self, mem: &RemoteMemory, c: &Chain, s: u8, n: u32) -> Result<u32, String> {
        let &(a, len) = c
            .writable
            .last()
            .ok_or("no device-writable byte for a status")?;
        let at = a
            .checked_add(len - 1)
            .ok_or("its status byte is past the address space")?;
        mem.write(at, &[s])
            .map_err(|e| format!("its status byte was not written: {e}"))?;
        Ok(n + 1)
    }
}

/// The error behind a failed ring access: the view's memory error if it has one, else
/// virtio-queue's own (a bad ring index).
fn queue_error(view: &crate::mem::RemoteView<'_>, e: virtio_queue::Error) -> MemError {
    view.take_error()
        .unwrap_or_else(|| MemError::Queue(e.to_string()))
}

mod ahead;
mod backend;
mod counters;
mod fill;
mod ranges;
use ranges::RangeOp;
mod read;
#[cfg(test)]
mod tests;
