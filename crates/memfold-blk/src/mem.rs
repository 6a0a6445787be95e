//! Guest RAM as the device reaches it: through QEMU's page tables, never through a
//! mapping of the guest memfd in this process.
//!
//! # The invariant
//!
//! **memfold-blk never reads or writes guest RAM through its own mapping of the guest
//! memfd.** Every access — descriptor table, avail and used rings, request headers, data
//! buffers, status bytes — is a `process_vm_readv`/`process_vm_writev` at QEMU's virtual
//! address for that guest-physical address ([`RemoteMemory`]). memfold's agent inside
//! QEMU maps pool frames over shared guest pages, punches stashed and reclaimed pages out
//! of the memfd and serves them through userfaultfd on QEMU's mapping. Through QEMU's page
//! tables a write to a shared page takes the write-protect fault a guest write takes (the
//! agent breaks the sharing first), a read of a stashed page takes the missing fault that
//! decodes it, and both wait for the agent's handler. Through the memfd a write would put
//! bytes under a page the guest does not see (its pool frame is mapped there) or fill a
//! hole the agent holds a blob for; a read would see zeros for a stashed page.
//!
//! vhost-user-backend maps every region it is sent (`GuestMemoryMmap`, in its
//! `set_mem_table`); that mapping is never used by this crate: [`RemoteMemory::from_mmap`]
//! only reads each region's guest address, length and file (fd, offset) from it.
//! virtio-queue's `Queue` methods are given a [`RemoteView`] instead, a vm-memory
//! `GuestMemory` whose slices are bounce buffers: filled from QEMU when they are handed
//! out for reading, written back to QEMU when vm-memory marks them dirty (every write
//! through a `VolatileSlice` does).
//!
//! A limit of the bounce design: virtio's 16-bit ring indices are read and written by
//! the kernel's user-copy routine (`process_vm_*`), not by one atomic instruction. A
//! torn index would break the ring; the test `a_remote_u16_store_is_never_seen_torn`
//! checks, on the host it runs on, that neither a remote store nor a remote load of a
//! 2-byte-aligned u16 is ever seen half done (it passes here, x86-64 with FSRM `rep
//! movsb`; split into two byte writes it fails at once).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fmt;
use std::iter::FusedIterator;
use std::os::fd::AsFd;
use std::rc::Rc;
use std::sync::Arc;

use memfold_ids::Gfn;
use vm_memory::bitmap::{Bitmap, BitmapSlice, WithBitmapSlice};
use vm_memory::guest_memory::GuestMemorySliceIterator;
use vm_memory::{
    GuestAddress, GuestMemory, GuestMemoryBackend, GuestMemoryError, GuestMemoryRegion,
    Permissions, VolatileSlice,
};

use crate::remote::{Qemu, RemoteError};

/// Guest page size, bytes.
pub const PAGE: u64 = 4096;

/// A guest RAM file: the memfd QEMU sent for a region, by `(st_dev, st_ino)` — the same
/// pair memfoldd sees for the memfd its agent reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RamFile {
    /// `st_dev` of the file.
    pub dev: u64,
    /// `st_ino` of the file.
    pub ino: u64,
}

/// One region of guest RAM: guest-physical `[gpa, gpa + len)` is bytes
/// `[file_off, file_off + len)` of `file`, which QEMU maps at `qemu_va`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// First guest-physical address.
    pub gpa: u64,
    /// Length, bytes.
    pub len: u64,
    /// QEMU's virtual address of `gpa`.
    pub qemu_va: u64,
    /// The RAM file.
    pub file: RamFile,
    /// Offset of `gpa` in the file, bytes (vhost-user's `mmap_offset`).
    pub file_off: u64,
}

/// Errors of guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemError {
    /// A guest-physical range is not (wholly) guest RAM.
    #[error("guest-physical [{gpa:#x}, +{len:#x}) is not in guest RAM")]
    OutOfRange {
        /// First address.
        gpa: u64,
        /// Length, bytes.
        len: u64,
    },
    /// A region has no file (vhost-user always sends one).
    #[error("region at guest-physical {gpa:#x} has no file")]
    NoFile {
        /// First address.
        gpa: u64,
    },
    /// The file of a region cannot be identified.
    #[error("region at guest-physical {gpa:#x}: fstat: {source}")]
    Fstat {
        /// First address.
        gpa: u64,
        /// The OS error.
        source: std::io::Error,
    },
    /// Reaching QEMU failed.
    #[error(transparent)]
    Remote(#[from] RemoteError),
    /// virtio-queue refused the rings (a bad index in guest memory).
    #[error("virtqueue: {0}")]
    Queue(String),
}

/// Guest RAM reached through QEMU's page tables (see the module's invariant).
#[derive(Debug)]
pub struct RemoteMemory {
    qemu: Arc<Qemu>,
    regions: Vec<Region>,
}

impl RemoteMemory {
    /// Guest RAM of `regions` in `qemu`.
    pub fn new(qemu: Arc<Qemu>, regions: Vec<Region>) -> RemoteMemory {
        RemoteMemory { qemu, regions }
    }

    /// The regions vhost-user-backend mapped (`mem`), found in `qemu`'s own address space:
    /// each region's file and offset are read from the mapping's `FileOffset` (fstat of
    /// the fd QEMU sent), and QEMU's address of it from `/proc/PID/maps`
    /// ([`Qemu::file_address`]). The mapping itself is never read or written.
    ///
    /// Errors: [`MemError::NoFile`], [`MemError::Fstat`], [`MemError::Remote`] (QEMU
    /// does not map the file there).
    pub fn from_mmap<M: GuestMemoryBackend>(
        qemu: Arc<Qemu>,
        mem: &M,
    ) -> Result<RemoteMemory, MemError> {
        let mut regions = Vec::new();
        for r in mem.iter() {
            let gpa = r.start_addr().0;
            let fo = r.file_offset().ok_or(MemError::NoFile { gpa })?;
            let (dev, ino) = memfold_sys::memfd::file_id(fo.file().as_fd())
                .map_err(|source| MemError::Fstat { gpa, source })?;
            let qemu_va = qemu.file_address(dev, ino, fo.start(), r.len())?;
            regions.push(Region {
                gpa,
                len: r.len(),
                qemu_va,
                file: RamFile { dev, ino },
                file_off: fo.start(),
            });
        }
        Ok(RemoteMemory { qemu, regions })
    }

    /// The regions.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// QEMU.
    pub fn qemu(&self) -> &Arc<Qemu> {
        &self.qemu
    }

    /// The pieces of guest-physical `[gpa, gpa + len)`, one per region it crosses:
    /// (region, offset in the region, length).
    ///
    /// Errors: [`MemError::OutOfRange`] (a byte of it is in no region, or it wraps).
    pub fn pieces(&self, gpa: u64, len: u64) -> Result<Vec<(Region, u64, u64)>, MemError> {
        gpa.checked_add(len)
            .ok_or(MemError::OutOfRange { gpa, len })?;
        let mut v = Vec::new();
        let (mut at, mut left) = (gpa, len);
        while left > 0 {
            let r = self
                .regions
                .iter()
                .find(|r| at >= r.gpa && at - r.gpa < r.len)
                .ok_or(MemError::OutOfRange { gpa, len })?;
            let off = at - r.gpa;
            let n = left.min(r.len - off);
            v.push((*r, off, n));
            at += n;
            left -= n;
        }
        Ok(v)
    }

    /// Whether all of `[gpa, gpa + len)` is guest RAM.
    pub fn contains(&self, gpa: u64, len: u64) -> bool {
        self.pieces(gpa, len).is_ok()
    }

    /// Reads guest-physical `[gpa, gpa + buf.len())` into `buf`, through QEMU.
    ///
    /// Errors: [`MemError::OutOfRange`] (nothing read), [`MemError::Remote`].
    pub fn read(&self, gpa: u64, buf: &mut [u8]) -> Result<(), MemError> {
        self.read_runs(&mut [(gpa, buf)])
    }

    /// Reads each `(gpa, buf)` from guest-physical `gpa`, through QEMU, all in as few
    /// system calls as the parts allow (one per 1 024 pieces): a request's scattered
    /// pages cost one call, not one each.
    ///
    /// Errors: [`MemError::OutOfRange`] (any run: nothing read), [`MemError::Remote`].
    pub fn read_runs(&self, runs: &mut [(u64, &mut [u8])]) -> Result<(), MemError> {
        let mut parts: Vec<(u64, &mut [u8])> = Vec::with_capacity(runs.len());
        for (gpa, buf) in runs.iter_mut() {
            let mut rest: &mut [u8] = buf;
            for (r, off, n) in self.pieces(*gpa, rest.len() as u64)? {
                let (a, b) = rest.split_at_mut(n as usize);
                parts.push((r.qemu_va + off, a));
                rest = b;
            }
        }
        Ok(self.qemu.read(&mut parts)?)
    }

    /// Writes `buf` to guest-physical `gpa`, through QEMU.
    ///
    /// Errors: [`MemError::OutOfRange`] (nothing written), [`MemError::Remote`] (a prefix
    /// may be written).
    pub fn write(&self, gpa: u64, buf: &[u8]) -> Result<(), MemError> {
        self.write_runs(&[(gpa, buf)])
    }

    /// Writes each `(gpa, buf)` to guest-physical `gpa`, through QEMU, in as few system
    /// calls as [`RemoteMemory::read_runs`] and under one hold of the write fence.
    ///
    /// Errors: [`MemError::OutOfRange`] (any run: nothing written), [`MemError::Remote`]
    /// (a prefix may be written).
    pub fn write_runs(&self, runs: &[(u64, &[u8])]) -> Result<(), MemError> {
        let mut parts: Vec<(u64, &[u8])> = Vec::with_capacity(runs.len());
        for &(gpa, buf) in runs {
            let mut rest = buf;
            for (r, off, n) in self.pieces(gpa, buf.len() as u64)? {
                let (a, b) = rest.split_at(n as usize);
                parts.push((r.qemu_va + off, a));
                rest = b;
            }
        }
        Ok(self.qemu.write(&parts)?)
    }

    /// The guest pages wholly inside guest-physical `[gpa, gpa + len)`, each as its RAM
    /// file, its page index in that file (file offset / 4096: not the guest-physical
    /// page; a file may back several regions) and the offset of the page's first byte
    /// from `gpa`. Partial pages at either end are left out; so are pages whose file
    /// offset is not page-aligned.
    pub fn whole_pages(&self, gpa: u64, len: u64) -> Vec<(RamFile, Gfn, u64)> {
        let mut v = Vec::new();
        let Ok(pieces) = self.pieces(gpa, len) else {
            return v;
        };
        let mut done = 0u64;
        for (r, off, n) in pieces {
            let f0 = r.file_off + off;
            let mut p = f0.div_ceil(PAGE) * PAGE;
            while p + PAGE <= f0 + n {
                if let Ok(g) = u32::try_from(p / PAGE) {
                    v.push((r.file, Gfn(g), done + (p - f0)));
                }
                p += PAGE;
            }
            done += n;
        }
        v
    }

    /// A view of this memory for virtio-queue (see [`RemoteView`]).
    pub fn view(&self) -> RemoteView<'_> {
        RemoteView {
            mem: self,
            failed: Rc::new(RefCell::new(None)),
            arena: RefCell::new(Vec::new()),
            held_bytes: Cell::new(0),
            peak_bytes: Cell::new(0),
            slices_made: Cell::new(0),
            windows: RefCell::new(None),
            remote_reads: Cell::new(0),
        }
    }
}

/// A bounce buffer of a [`RemoteView`] slice: `len` bytes of QEMU's memory at `qemu_va`.
struct Bounce {
    qemu: Arc<Qemu>,
    qemu_va: u64,
    /// 8-byte aligned storage (atomic loads and stores of virtio-queue need alignment).
    buf: Box<[std::cell::UnsafeCell<u64>]>,
    len: usize,
    failed: Rc<RefCell<Option<MemError>>>,
}

impl Bounce {
    fn ptr(&self) -> *mut u8 {
        self.buf.as_ptr() as *mut u8
    }
}

/// vm-memory's dirty bitmap, used as a write-back: marking bytes of a [`RemoteView`]
/// slice dirty (vm-memory does after every write through a `VolatileSlice`) writes them to
/// QEMU. A failed write is kept in the view ([`RemoteView::take_error`]), since
/// `mark_dirty` cannot return one.
#[derive(Clone, Default)]
pub struct WriteBack {
    target: Option<Rc<Bounce>>,
    base: usize,
}

impl fmt::Debug for WriteBack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.target {
            Some(t) => write!(f, "WriteBack(qemu {:#x} + {})", t.qemu_va, self.base),
            None => f.write_str("WriteBack(none)"),
        }
    }
}

impl WithBitmapSlice<'_> for WriteBack {
    type S = WriteBack;
}

impl BitmapSlice for WriteBack {}

impl Bitmap for WriteBack {
    fn mark_dirty(&self, offset: usize, len: usize) {
        let Some(t) = &self.target else { return };
        let start = self.base + offset;
        if len == 0 || start >= t.len {
            return;
        }
        let len = len.min(t.len - start);
        let mut bytes = vec![0u8; len];
        // SAFETY: [start, start + len) is inside the bounce buffer (clamped above), which
        // `t` keeps alive; the slices over it are used by this thread only, and the copy
        // is volatile as every access through a VolatileSlice is.
        unsafe {
            for (i, b) in bytes.iter_mut().enumerate() {
                *b = std::ptr::read_volatile(t.ptr().add(start + i));
            }
        }
        if let Err(e) = t.qemu.write(&[(t.qemu_va + start as u64, &bytes)]) {
            t.failed.borrow_mut().get_or_insert(MemError::Remote(e));
        }
    }

    fn dirty_at(&self, _offset: usize) -> bool {
        false
    }

    fn slice_at(&self, offset: usize) -> WriteBack {
        WriteBack {
            target: self.target.clone(),
            base: self.base + offset,
        }
    }
}

/// [`RemoteMemory`] as a vm-memory `GuestMemory`, for virtio-queue: each slice it hands
/// out is a bounce buffer, filled from QEMU when asked for reading and written back to
/// QEMU as it is written (see [`WriteBack`]). One view serves one batch of queue work on
/// one thread; its bounce buffers are freed by [`RemoteView::release`] (after each
/// request) or with it.
pub struct RemoteView<'m> {
    mem: &'m RemoteMemory,
    failed: Rc<RefCell<Option<MemError>>>,
    /// Every bounce buffer handed out since the last [`RemoteView::release`]: vm-memory
    /// takes the memory behind a slice borrowed from the view to live as long as the
    /// borrow, and a pointer a slice gave out (`ptr_guard`) holds no `Rc` of its own.
    arena: RefCell<Vec<Rc<Bounce>>>,
    /// Bytes of the buffers in `arena`, and the most it held at once.
    held_bytes: Cell<u64>,
    peak_bytes: Cell<u64>,
    slices_made: Cell<u64>,
    /// While a chain's descriptors are read ([`RemoteView::reading_descriptors`]): the
    /// windows of guest RAM read for them, by guest page (one lookup a descriptor, not
    /// a scan of every window).
    windows: RefCell<Option<HashMap<u64, Window>>>,
    remote_reads: Cell<u64>,
}

/// A window of guest RAM read once for a chain's descriptors: (guest-physical address,
/// bytes).
type Window = (u64, Vec<u8>);

/// Most bytes one read-only access may take from a descriptor window: a descriptor is
/// 16 bytes; anything larger is read as usual.
const WINDOWED: usize = 64;

impl RemoteView<'_> {
    /// The first error a read for a slice or a write-back met since the last call (virtio
    /// -queue turns a failed read into an ended chain or a queue error; a write-back
    /// cannot report at all).
    pub fn take_error(&self) -> Option<MemError> {
        self.failed.borrow_mut().take()
    }

    /// Bounce slices handed out so far (tests: the queue went through this view).
    pub fn slices_made(&self) -> u64 {
        self.slices_made.get()
    }

    /// Reads of QEMU's memory this view made (each one `process_vm_readv`).
    pub fn remote_reads(&self) -> u64 {
        self.remote_reads.get()
    }

    /// The most bytes of bounce buffers the view held at once (tests: what a request, not
    /// a batch of them, pins).
    pub fn peak_bounce_bytes(&self) -> u64 {
        self.peak_bytes.get()
    }

    /// Frees the bounce buffers handed out so far (the device calls it once a request is
    /// answered, so that a pass holds one request's buffers, not every request's).
    ///
    /// Invariant (why this is sound): every slice, sub-slice and reference vm-memory
    /// makes over a buffer carries the view's borrow (`get_slices(&'a self)` gives
    /// `VolatileSlice<'a>`), so while one exists `&mut self` cannot be had: the borrow
    /// checker proves none is alive here, nor a `DescriptorChain` (it holds the view by
    /// reference), nor a virtio-queue call under way (a raw pointer of `ptr_guard` lives
    /// inside one). A `WriteBack` kept anyway holds its own `Rc`: its buffer lives on.
    pub fn release(&mut self) {
        self.arena.get_mut().clear();
        self.held_bytes.set(0);
    }

    /// Between `true` and `false`, small read-only accesses (virtio-queue's descriptor
    /// reads, in a table or an indirect table) are served from windows of guest RAM read
    /// once each: a descriptor's page (its part in guest RAM), read at its first use. A
    /// chain of 66 descriptors (a 256 KiB request over scattered pages) costs one or two
    /// reads, not 66.
    ///
    /// Only for descriptors: the driver does not change a chain it made available until
    /// the device has used it (virtio 1.1 §2.6.13), so a window read after the chain's
    /// avail index holds what a read of each descriptor would. The rings' indexes are
    /// never windowed, since they change under the device. The window stays in its page,
    /// so no page the chain does not use is faulted in.
    pub fn reading_descriptors(&self, on: bool) {
        *self.windows.borrow_mut() = on.then(HashMap::new);
    }

    /// `count` bytes at `gpa` from a descriptor window, read now if no window holds them;
    /// `None` when not reading descriptors, or the access is larger than [`WINDOWED`] or
    /// does not fit in its page.
    fn windowed(&self, gpa: u64, count: usize) -> Option<Result<Vec<u8>, GuestMemoryError>> {
        let mut windows = self.windows.borrow_mut();
        let windows = windows.as_mut()?;
        if count > WINDOWED {
            return None;
        }
        let end = gpa.checked_add(count as u64)?;
        let page = gpa / PAGE;
        if let Some((at, w)) = windows.get(&page) {
            // Not inside it (a region ends in the page): read as usual.
            let from = gpa
                .checked_sub(*at)
                .filter(|_| end <= at + w.len() as u64)?;
            let from = from as usize;
            return Some(Ok(w[from..from + count].to_vec()));
        }
        let r = self
            .mem
            .regions
            .iter()
            .find(|r| gpa >= r.gpa && gpa - r.gpa < r.len)?;
        let at = (page * PAGE).max(r.gpa);
        let off = at - r.gpa;
        let n = (PAGE - at % PAGE).min(r.len - off) as usize;
        if end > at + n as u64 {
            return None;
        }
        let mut w = vec![0u8; n];
        self.remote_reads.set(self.remote_reads.get() + 1);
        if let Err(e) = self.mem.qemu.read(&mut [(r.qemu_va + off, &mut w)]) {
            let msg = e.to_string();
            self.failed.borrow_mut().get_or_insert(MemError::Remote(e));
            return Some(Err(GuestMemoryError::IOError(std::io::Error::other(msg))));
        }
        let from = (gpa - at) as usize;
        let out = w[from..from + count].to_vec();
        windows.insert(page, (at, w));
        Some(Ok(out))
    }

    fn bounce(&self, qemu_va: u64, len: usize, fill: bool) -> Result<Rc<Bounce>, GuestMemoryError> {
        let words = len.div_ceil(8).max(1);
        let b = Rc::new(Bounce {
            qemu: self.mem.qemu.clone(),
            qemu_va,
            buf: (0..words).map(|_| std::cell::UnsafeCell::new(0)).collect(),
            len,
            failed: self.failed.clone(),
        });
        if fill {
            // SAFETY: the buffer is `words * 8 >= len` bytes, owned by `b`, no slice over
            // it exists yet.
            let dst = unsafe { std::slice::from_raw_parts_mut(b.ptr(), len) };
            self.remote_reads.set(self.remote_reads.get() + 1);
            if let Err(e) = self.mem.qemu.read(&mut [(qemu_va, dst)]) {
                let msg = e.to_string();
                self.failed.borrow_mut().get_or_insert(MemError::Remote(e));
                return Err(GuestMemoryError::IOError(std::io::Error::other(msg)));
            }
        }
        self.arena.borrow_mut().push(b.clone());
        let held = self.held_bytes.get() + len as u64;
        self.held_bytes.set(held);
        self.peak_bytes.set(self.peak_bytes.get().max(held));
        self.slices_made.set(self.slices_made.get() + 1);
        Ok(b)
    }
}

/// The slices of one [`RemoteView::get_slices`] call.
pub struct Slices<'a>(std::vec::IntoIter<Result<VolatileSlice<'a, WriteBack>, GuestMemoryError>>);

impl<'a> Iterator for Slices<'a> {
    type Item = Result<VolatileSlice<'a, WriteBack>, GuestMemoryError>;
    fn next(&mut self) -> Option<Self::Item> {
        self.0.next()
    }
}

impl FusedIterator for Slices<'_> {}

impl<'a> GuestMemorySliceIterator<'a, WriteBack> for Slices<'a> {}

impl GuestMemory for RemoteView<'_> {
    /// Never returned ([`GuestMemory::physical_memory`] is `None`: there is no local
    /// memory behind this view).
    type PhysicalMemory = vm_memory::GuestMemoryMmap<()>;
    type Bitmap = WriteBack;

    fn check_range(&self, addr: GuestAddress, count: usize, _access: Permissions) -> bool {
        self.mem.contains(addr.0, count as u64)
    }

    fn get_slices<'a>(
        &'a self,
        addr: GuestAddress,
        count: usize,
        access: Permissions,
    ) -> Result<impl GuestMemorySliceIterator<'a, WriteBack>, GuestMemoryError> {
        let pieces = self
            .mem
            .pieces(addr.0, count as u64)
            .map_err(|_| GuestMemoryError::InvalidGuestAddress(addr))?;
        let mut v = Vec::with_capacity(pieces.len());
        if let ([(r, off, n)], Permissions::Read) = (pieces.as_slice(), access) {
            if let Some(bytes) = self.windowed(addr.0, count) {
                let b = self.bounce(r.qemu_va + off, *n as usize, false)?;
                // SAFETY: the new buffer is at least `n` = `count` bytes, no slice over it
                // exists yet.
                unsafe { std::ptr::copy_nonoverlapping(bytes?.as_ptr(), b.ptr(), count) };
                let bitmap = WriteBack {
                    target: Some(b.clone()),
                    base: 0,
                };
                // SAFETY: as below.
                v.push(Ok(unsafe {
                    VolatileSlice::with_bitmap(b.ptr(), *n as usize, bitmap, None)
                }));
                return Ok(Slices(v.into_iter()));
            }
        }
        for (r, off, n) in pieces {
            // Reads fill the buffer from QEMU first; writes need not (only the bytes
            // written are written back).
            match self.bounce(r.qemu_va + off, n as usize, access.allow(Permissions::Read)) {
                Ok(b) => {
                    let bitmap = WriteBack {
                        target: Some(b.clone()),
                        base: 0,
                    };
                    // SAFETY: the buffer is at least `n` bytes, 8-aligned, and lives until
                    // the view's next `release` (its arena holds it; no slice borrowing the
                    // view outlives that, see `release`) and as long as any bitmap clone;
                    // nothing else accesses it but through these slices.
                    v.push(Ok(unsafe {
                        VolatileSlice::with_bitmap(b.ptr(), n as usize, bitmap, None)
                    }));
                }
                Err(e) => {
                    v.push(Err(e));
                    break;
                }
            }
        }
        Ok(Slices(v.into_iter()))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::sync::atomic::Ordering;
    use vm_memory::Bytes;

    /// A memfd of `pages` pages mapped in this process at `ptr`, and a [`RemoteMemory`]
    /// reaching it as "QEMU" = this process, guest-physical 0 at file offset 0.
    pub(crate) struct Local {
        /// The memfd (kept open for the mapping's and the tests' sake).
        pub _fd: OwnedFd,
        pub ptr: *mut u8,
        pub len: usize,
        pub mem: RemoteMemory,
    }

    impl Local {
        pub(crate) fn new(pages: usize) -> Local {
            let fd = memfold_sys::memfd::create("mem-test").unwrap();
            let len = pages * PAGE as usize;
            memfold_sys::memfd::set_len(fd.as_fd(), len as u64).unwrap();
            // SAFETY: a new shared mapping of our own memfd, unmapped on drop.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(ptr, libc::MAP_FAILED);
            let (dev, ino) = memfold_sys::memfd::file_id(fd.as_fd()).unwrap();
            let mem = RemoteMemory::new(
                Arc::new(Qemu::open(std::process::id()).unwrap()),
                vec![Region {
                    gpa: 0,
                    len: len as u64,
                    qemu_va: ptr as u64,
                    file: RamFile { dev, ino },
                    file_off: 0,
                }],
            );
            Local {
                _fd: fd,
                ptr: ptr.cast(),
                len,
                mem,
            }
        }

        pub(crate) fn bytes(&self) -> &[u8] {
            // SAFETY: the mapping is `len` bytes and lives as long as self.
            unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
        }
    }

    impl Drop for Local {
        fn drop(&mut self) {
            // SAFETY: the mapping made in new, no longer used.
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }

    #[test]
    fn the_view_reads_and_writes_through_qemu_and_atomics_land() {
        let l = Local::new(4);
        let v = l.mem.view();
        v.write_slice(b"hello", GuestAddress(4094)).unwrap();
        assert_eq!(&l.bytes()[4094..4099], b"hello");
        let mut b = [0u8; 5];
        v.read_slice(&mut b, GuestAddress(4094)).unwrap();
        assert_eq!(&b, b"hello");
        v.store(0xBEEFu16, GuestAddress(2), Ordering::Release)
            .unwrap();
        assert_eq!(&l.bytes()[2..4], &0xBEEFu16.to_ne_bytes());
        assert_eq!(
            v.load::<u16>(GuestAddress(2), Ordering::Acquire).unwrap(),
            0xBEEF
        );
        assert!(v.read_slice(&mut b, GuestAddress(4 * 4096 - 2)).is_err());
        assert!(v.take_error().is_none());
        assert!(v.slices_made() >= 4);
    }

    #[test]
    fn whole_pages_are_named_by_file_offset_and_partial_ones_left_out() {
        let l = Local::new(4);
        let mut m = RemoteMemory::new(l.mem.qemu.clone(), l.mem.regions.clone());
        // One file in two regions, the second at guest-physical 1 GiB (q35's split).
        let r0 = m.regions[0];
        m.regions = vec![
            Region {
                len: 2 * PAGE,
                ..r0
            },
            Region {
                gpa: 1 << 30,
                len: 2 * PAGE,
                qemu_va: r0.qemu_va + 2 * PAGE,
                file_off: 2 * PAGE,
                ..r0
            },
        ];
        let f = r0.file;
        assert_eq!(
            m.whole_pages(0, 2 * PAGE),
            vec![(f, Gfn(0), 0), (f, Gfn(1), PAGE)]
        );
        assert_eq!(
            m.whole_pages(512, 2 * PAGE - 512),
            vec![(f, Gfn(1), PAGE - 512)]
        );
        assert_eq!(m.whole_pages((1 << 30) + PAGE, PAGE), vec![(f, Gfn(3), 0)]);
        assert!(m.whole_pages(2 * PAGE, PAGE).is_empty(), "not guest RAM");
        assert!(m.pieces(PAGE, 2 * PAGE).is_err(), "crosses a gap");
        assert!(m.pieces(u64::MAX - 2, 8).is_err(), "wraps");
    }

    /// virtio's ring indices are 16-bit values the guest reads while the device writes
    /// them (and the other way round): a remote write must not be seen half done. The
    /// kernel copies `process_vm_writev`'s bytes with its `copy_from_user` (on this CPU
    /// `rep movsb`, FSRM), which makes no such promise; this checks it on the host at
    /// hand: a reader spinning on a u16 while the device flips it between 0x00FF and
    /// 0x0100 (every byte changes) must never see 0x0000 or 0x01FF.
    #[test]
    fn a_remote_u16_store_is_never_seen_torn() {
        use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64};
        let l = Local::new(1);
        // SAFETY: the mapping is 4096 bytes, 2-aligned at offset 64, alive for the test;
        // every access to it is atomic or through the kernel.
        let word: &AtomicU16 = unsafe { &*(l.ptr.add(64) as *const AtomicU16) };
        word.store(0x00FF, Ordering::SeqCst);
        let stop = Arc::new(AtomicBool::new(false));
        let torn = Arc::new(AtomicU64::new(0));
        let addr = l.ptr as usize + 64;
        let (s2, t2) = (stop.clone(), torn.clone());
        let reader = std::thread::spawn(move || {
            // SAFETY: as above; the test joins this thread before unmapping.
            let w: &AtomicU16 = unsafe { &*(addr as *const AtomicU16) };
            while !s2.load(Ordering::Relaxed) {
                let v = w.load(Ordering::Relaxed);
                if v != 0x00FF && v != 0x0100 {
                    t2.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        for i in 0..200_000u32 {
            let v: u16 = if i % 2 == 0 { 0x0100 } else { 0x00FF };
            l.mem.write(64, &v.to_le_bytes()).unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        reader.join().unwrap();
        assert_eq!(torn.load(Ordering::Relaxed), 0, "torn 16-bit values seen");
        // And the other way: the guest flips it, the device reads it remotely.
        stop.store(false, Ordering::Relaxed);
        let s3 = stop.clone();
        let writer = std::thread::spawn(move || {
            // SAFETY: as above.
            let w: &AtomicU16 = unsafe { &*(addr as *const AtomicU16) };
            while !s3.load(Ordering::Relaxed) {
                w.store(0x0100, Ordering::Relaxed);
                w.store(0x00FF, Ordering::Relaxed);
            }
        });
        let mut seen_torn = 0;
        for _ in 0..200_000 {
            let mut b = [0u8; 2];
            l.mem.read(64, &mut b).unwrap();
            let v = u16::from_le_bytes(b);
            if v != 0x00FF && v != 0x0100 {
                seen_torn += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        assert_eq!(seen_torn, 0, "torn 16-bit values read");
    }
}
