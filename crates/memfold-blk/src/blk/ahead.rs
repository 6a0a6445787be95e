//! Reading ahead: the next request's disk read runs on a reader thread while the
//! device copies this one's bytes into guest RAM and while the guest takes its
//! completion, instead of after both. QEMU's own virtio-blk overlaps its requests in its
//! thread pool, and copies nothing: the disk reads straight into guest RAM, which
//! memfold-blk may not write outside QEMU's page tables (`crate::mem`). Here, copying a
//! 504 KiB request whose bytes the disk has just written takes ~0.2 ms
//! (`process_vm_writev`), the disk read ~0.3 ms, and the guest ~0.4 ms under TCG from the
//! device's call to its next request (docs/sharing-at-read.md "Reading ahead").
//!
//! What is read ahead:
//! - after a large request (a chain with over [`AHEAD_MIN`] writable bytes: a read),
//!   the next request **already waiting in the ring**, if it is a read: looked at without being taken ([`peek_read`]: its
//!   chain and header read, the ring's position put back), started before this
//!   request's copy;
//! - once nothing waits (the end of a pass), in a sequential stream — the last read
//!   began where the one before it ended — the range right after it, as long as the
//!   longer of the two ([`ReadAhead::served`], [`ReadAhead::guess`]): a guess, which
//!   costs one disk read when wrong (`read_ahead_dropped`). Random reads start none.
//!
//! A read is served from bytes read ahead when they cover its range (a 16 KiB tail of a
//! 1 MiB read, guessed 504 KiB long, takes its first 16 KiB).
//!
//! **Invariant:** bytes read ahead are given only to a read inside their range, only
//! if no request but reads was served since they were read, and only if the base image
//! is still the one they were read from: every request but a read waits for a read
//! ahead under way and drops it ([`ReadAhead::drop_pending`], called by
//! `BlkBackend::request` before it touches the disk), so a write or discard served
//! since can never be shadowed by bytes read before it; a read served from them checks
//! the base first (`Disk::check_base`, as every read checks after itself). A read ahead
//! that failed, or whose base changed, is dropped and the request reads the disk itself,
//! getting (and reporting) its own error.

use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use virtio_bindings::virtio_blk as vb;
use virtio_queue::{Queue, QueueT};

use super::{gather, HEADER, MAX_CHAIN, MAX_DATA};
use crate::aligned::Aligned;
use crate::disk::{Disk, DiskError, Extent, SECTOR};
use crate::mem::{RemoteMemory, RemoteView};

/// Writable bytes of a chain (a read's data and status byte) past which the next
/// request is looked at, so that its disk read overlaps this one's copy: below it the
/// copy takes a few µs, less than the look costs (four or five reads of QEMU's memory).
pub const AHEAD_MIN: u64 = 64 << 10;

/// The read buffers a device keeps between requests at most, bytes each: a 1 MiB read
/// is two to four requests of up to 504 KiB (`seg_max` 126 pages); a larger one (up to
/// `MAX_DATA`, 31.5 MiB) gets a buffer of its own, dropped after it.
pub const KEEP_READ_BUF: usize = 2 << 20;

/// Read buffers kept: the one a request's bytes are copied from and the one the next
/// request's disk read lands in meanwhile.
const KEPT_BUFFERS: usize = 2;

/// The device's read buffers and its read ahead, if one is under way.
pub(super) struct ReadAhead {
    /// The reader thread, started at the first read ahead (none if it could not be).
    reader: Option<Reader>,
    /// The range of the read ahead under way, bytes (offset, length).
    pending: Option<(u64, u64)>,
    /// Aligned buffers free for the next disk read (at most [`KEPT_BUFFERS`]).
    free: Vec<Aligned>,
    /// The disk range of the request after the one being served, if it is a read
    /// (set by `serve_pass` before each request, [`peek_read`]).
    pub(super) next: Option<(u64, u64)>,
    /// No reads ahead: the device has a read rate (each read waits its turn,
    /// `throttle_read`), or the reader thread could not be started or died.
    off: bool,
    /// Reads ahead whose bytes were dropped unused (disk reads wasted).
    pub(super) dropped: u64,
    /// Bytes the reader thread read from the disk.
    pub(super) read_bytes: u64,
    /// The last read served from the disk or read ahead: (offset, length), bytes.
    last: Option<(u64, u64)>,
    /// The range after it, if it continued a sequential stream: what
    /// [`ReadAhead::guess`] reads once nothing waits.
    after: Option<(u64, u64)>,
}

/// The reader thread's two ends: one read at a time goes in, its bytes come back.
struct Reader {
    jobs: mpsc::Sender<Job>,
    /// Behind a lock only for `Sync` (the device is shared by its queues' threads, one
    /// at a time): never contended.
    done: Mutex<mpsc::Receiver<Done>>,
}

/// A disk read for the reader thread: `buf.len()` bytes at `off`.
struct Job {
    disk: Arc<dyn Disk>,
    off: u64,
    buf: Aligned,
}

/// A finished [`Job`]: its buffer and what [`Disk::read`] returned.
struct Done {
    buf: Aligned,
    extents: Result<Vec<Extent>, DiskError>,
}

impl ReadAhead {
    /// Read buffers, and reads ahead unless `off`.
    pub(super) fn new(off: bool) -> ReadAhead {
        ReadAhead {
            reader: None,
            pending: None,
            free: Vec::new(),
            next: None,
            off,
            dropped: 0,
            read_bytes: 0,
            last: None,
            after: None,
        }
    }

    /// Whether reads ahead are on (looking at the next request is worth its cost).
    pub(super) fn on(&self) -> bool {
        !self.off
    }

    /// A buffer of `len` bytes for a disk read (a kept one if any: its bytes are an
    /// earlier read's until the disk writes them all, as [`Disk::read`] does).
    pub(super) fn buffer(&mut self, len: usize) -> Aligned {
        let mut b = self.free.pop().unwrap_or_default();
        b.reuse(len);
        b
    }

    /// Takes back a buffer once its bytes are in guest RAM: kept for the next read
    /// unless a rare large request grew it past what is worth holding.
    pub(super) fn give_back(&mut self, buf: Aligned) {
        if buf.capacity() <= KEEP_READ_BUF && self.free.len() < KEPT_BUFFERS {
            self.free.push(buf);
        }
    }

    /// Starts reading `len` bytes at `off` of `disk` on the reader thread (started
    /// now if it is not yet). Does nothing if a read ahead is under way or the thread
    /// cannot be started.
    pub(super) fn start(&mut self, disk: &Arc<dyn Disk>, off: u64, len: u64) {
        if self.pending.is_some() || !self.ensure_reader() {
            return;
        }
        let job = Job {
            disk: Arc::clone(disk),
            off,
            buf: self.buffer(len as usize),
        };
        let reader = self.reader.as_ref().expect("ensure_reader made it");
        match reader.jobs.send(job) {
            Ok(()) => self.pending = Some((off, len)),
            Err(mpsc::SendError(job)) => {
                // The thread is gone (it only ends when its channel closes, or by a
                // panic in a disk read): serve reads in turn from now on.
                self.give_back(job.buf);
                self.reader = None;
                self.off = true;
            }
        }
    }

    /// The bytes read ahead if they cover `[off, off + len)` and were read without
    /// error: (their buffer, where they came from, the offset of `off` in the buffer,
    /// bytes). Any read ahead under way is waited for and, if it does not cover the
    /// range, dropped.
    pub(super) fn take(&mut self, off: u64, len: u64) -> Option<(Aligned, Vec<Extent>, usize)> {
        let (at, n) = self.pending?;
        let done = self.wait()?;
        let covers = at <= off && off + len <= at + n;
        match done.extents {
            Ok(extents) if covers => Some((done.buf, extents, (off - at) as usize)),
            _ => {
                self.drop_unused(done.buf);
                None
            }
        }
    }

    /// Notes a read of `len` bytes at `off` served (from the disk or read ahead): if it
    /// began where the last ended, the range after it, as long as the longer of the
    /// two, is what [`ReadAhead::guess`] reads next.
    pub(super) fn served(&mut self, off: u64, len: u64) {
        self.after = self
            .last
            .filter(|&(o, n)| o + n == off)
            .map(|(_, n)| (off + len, len.max(n)));
        self.last = Some((off, len));
    }

    /// Once nothing waits in the ring: reads ahead the range after a sequential
    /// stream's last read ([`ReadAhead::served`]), cut at the end of `disk`, unless a
    /// read ahead is under way.
    pub(super) fn guess(&mut self, disk: &Arc<dyn Disk>) {
        let Some((off, len)) = self.after.take() else {
            return;
        };
        let len = len.min(disk.size().saturating_sub(off));
        if len > 0 {
            self.start(disk, off, len);
        }
    }

    /// Drops bytes read ahead unused (counted: a disk read wasted); [`ReadAhead::take`]'s
    /// caller too, for bytes it cannot serve after all (the base changed since).
    pub(super) fn drop_unused(&mut self, buf: Aligned) {
        self.dropped += 1;
        self.give_back(buf);
    }

    /// Waits for a read ahead under way and drops its bytes: what every request but a
    /// read does before it is served (the module's invariant). No guess is made
    /// after it: the stream is broken.
    pub(super) fn drop_pending(&mut self) {
        self.after = None;
        if self.pending.is_some() {
            if let Some(done) = self.wait() {
                self.drop_unused(done.buf);
            }
        }
    }

    /// Whether a read ahead is under way (tests).
    #[cfg(test)]
    pub(super) fn is_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// The read ahead under way, finished: `None` if the reader thread died with it.
    fn wait(&mut self) -> Option<Done> {
        self.pending = None;
        let reader = self.reader.as_ref()?;
        let done = reader.done.lock().unwrap_or_else(|p| p.into_inner()).recv();
        match done {
            Ok(done) => {
                if done.extents.is_ok() {
                    self.read_bytes += done.buf.bytes().len() as u64;
                }
                Some(done)
            }
            Err(_) => {
                tracing::error!("the read-ahead thread died; reads are served in turn");
                self.reader = None;
                self.off = true;
                None
            }
        }
    }

    /// Starts the reader thread if it is not running; whether it is.
    fn ensure_reader(&mut self) -> bool {
        if self.reader.is_some() {
            return true;
        }
        if self.off {
            return false;
        }
        let (jobs, job_rx) = mpsc::channel::<Job>();
        let (done_tx, done) = mpsc::channel::<Done>();
        let spawned = std::thread::Builder::new()
            .name("memfold-blk-ahead".into())
            .spawn(move || {
                // Ends when the device drops its end of the channel.
                while let Ok(Job { disk, off, mut buf }) = job_rx.recv() {
                    let extents = disk.read(off, buf.bytes_mut());
                    // The device's `discard` needs the disk to itself (`Arc::get_mut`):
                    // this reference is gone before the device hears the read is done.
                    drop(disk);
                    if done_tx.send(Done { buf, extents }).is_err() {
                        return;
                    }
                }
            });
        match spawned {
            Ok(_) => {
                self.reader = Some(Reader {
                    jobs,
                    done: Mutex::new(done),
                });
                true
            }
            Err(e) => {
                tracing::warn!("no read-ahead thread ({e}): reads are served in turn");
                self.off = true;
                false
            }
        }
    }
}

impl Drop for ReadAhead {
    /// A read under way is waited for: the reader thread then holds no reference to the
    /// disk, which closes (its lock on the overlay released) with the device.
    fn drop(&mut self) {
        self.drop_pending();
    }
}

/// The disk range `(offset, length)` in bytes of the next available request, if it is
/// a read of whole sectors inside a disk of `disk_size` bytes; the queue is left at the
/// same position (the request is served in its turn). Anything the look cannot read or
/// make sense of is `None`: the request's own serving finds and answers it.
pub(super) fn peek_read(
    queue: &mut Queue,
    mem: &RemoteMemory,
    view: &RemoteView<'_>,
    disk_size: u64,
) -> Option<(u64, u64)> {
    let at = queue.next_avail();
    let waiting = queue
        .avail_idx(view, Ordering::Acquire)
        .map(|avail| avail.0.wrapping_sub(at));
    let range = match waiting {
        Ok(w) if w > 0 && w <= queue.size() => {
            let chain = queue.pop_descriptor_chain(view);
            queue.set_next_avail(at);
            chain.and_then(|chain| {
                // The header starts the first readable descriptor (one split over two
                // is the request's own to serve: no read ahead for it).
                let (mut first, mut writable) = (None, 0u64);
                view.reading_descriptors(true);
                for d in chain.take(MAX_CHAIN) {
                    if d.is_write_only() {
                        writable = writable.saturating_add(d.len() as u64);
                    } else if first.is_none() {
                        first = Some((d.addr().0, d.len() as u64));
                    }
                }
                view.reading_descriptors(false);
                let header = first.filter(|&(_, n)| n >= HEADER)?;
                let h = gather(mem, &[header], 0, HEADER).ok()?;
                let kind = u32::from_le_bytes(h[0..4].try_into().expect("4 bytes"));
                let sector = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
                let len = writable.checked_sub(1)?;
                let off = sector.checked_mul(SECTOR)?;
                let fits = off.checked_add(len).is_some_and(|end| end <= disk_size);
                (kind == vb::VIRTIO_BLK_T_IN
                    && len > 0
                    && len % SECTOR == 0
                    && len <= MAX_DATA
                    && fits)
                    .then_some((off, len))
            })
        }
        _ => None,
    };
    // A ring the look could not read is the request's to fail on, in its turn.
    let _ = view.take_error();
    range
}
