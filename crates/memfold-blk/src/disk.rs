//! The disk images a device serves (Satori §4.1, copy-on-write disks): a read-only raw
//! base image, alone ([`RawDisk`]: a data disk) or under a per-guest qcow2 overlay
//! ([`OverlayDisk`]: a root disk, the base shared by every guest of a profile).
//!
//! Every read says where each of its bytes came from ([`Extent`]), which is what lets a
//! base block be named by (base, block number) alone.
//!
//! The host page cache is kept from holding a third copy of what the guest's page cache
//! and memfold's pool already hold: the raw base is read with `O_DIRECT` (straight into
//! the device's aligned read buffer; a bounce buffer only for an unaligned range), and
//! the qcow2 overlay is opened with `O_DIRECT` too, imago reading and writing through
//! the device's own descriptors of both files (`open.rs`). Where a file system refuses
//! `O_DIRECT` (and with `memfold-blk --no-direct`) I/O is buffered and each range is
//! dropped with `POSIX_FADV_DONTNEED` after use — which measurably does not work. Bytes
//! of the image in the host page cache (`fincore`) after a TCG guest used the disk, cache
//! dropped before, ext4 host (2026-11-24, /var/tmp/blk-measure/{run,root}.sh in the
//! report of issue 16's block device):
//!
//! | disk | `O_DIRECT` | buffered + `DONTNEED` |
//! |---|---|---|
//! | 64 MiB raw data disk, read whole by the tiny guest | 0 | 65 601 536 (all of it) |
//! | web root: raw base under a qcow2 overlay, boot to ready (21 MB read) | base 0, overlay 65 536 | base 18 440 192, overlay 0 |
//!
//! (Readahead reads past the range dropped, and pages just read may sit in per-CPU LRU
//! batches that `DONTNEED` skips.) So `O_DIRECT` is the default and the fallback is only
//! a fallback.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use imago::file::File as ImagoFile;
use imago::{FormatAccess, ShallowMapping};

use crate::aligned::{fits_direct, read_fully, Aligned};
use crate::landed::{DiskId, Source};

mod error;
mod guard;
mod open;
mod repair;
mod stamp;
mod sync_latch;
pub use error::DiskError;
pub use guard::{BaseGuard, BaseStamp, Mismatch};
pub use open::check_overlay;
pub use repair::dirty_path;
pub use stamp::stamp_path;

/// Sector size of virtio-blk, bytes.
pub const SECTOR: u64 = 512;
/// Block size the device announces and reads in (`O_DIRECT` alignment), bytes.
pub const BLOCK: u64 = 4096;

/// A run of a read's bytes and where they came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Disk byte offset of the run's first byte.
    pub off: u64,
    /// Length, bytes.
    pub len: u64,
    /// Where from. For [`Source::Base`] `block` is the block of `off` (4 KiB units,
    /// rounded down); a page's own block is computed from its offset.
    pub source: ExtentSource,
}

/// Where an extent's bytes came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtentSource {
    /// The base image `disk`, at the same byte offset (a raw base maps the disk 1:1).
    Base(DiskId),
    /// The overlay.
    Overlay,
    /// Zeros.
    Zero,
}

impl ExtentSource {
    /// The [`Source`] of the 4 KiB page whose bytes are this extent's at disk offset
    /// `off`; `None` for a base page that is not one whole base block (`off` unaligned).
    pub fn page_source(self, off: u64) -> Option<Source> {
        match self {
            ExtentSource::Base(disk) => (off % BLOCK == 0).then_some(Source::Base {
                disk,
                block: off / BLOCK,
            }),
            ExtentSource::Overlay => Some(Source::Overlay),
            ExtentSource::Zero => Some(Source::Zero),
        }
    }
}

/// A disk the device serves. Offsets and lengths in bytes.
pub trait Disk: Send + Sync {
    /// Size, bytes.
    fn size(&self) -> u64;
    /// Whether writes are refused (`VIRTIO_BLK_F_RO`).
    fn read_only(&self) -> bool;
    /// Whether discard and write-zeroes are supported (a writable disk whose ranges can
    /// be dropped: an overlay).
    fn can_discard(&self) -> bool;
    /// Reads `buf.len()` bytes at `off` into `buf`, writing every byte of it (the device
    /// reuses its buffer: a byte left unwritten would be an earlier read's); returns
    /// where they came from, in order, covering `buf`.
    ///
    /// Errors: [`DiskError::OutOfRange`], [`DiskError::Io`].
    fn read(&self, off: u64, buf: &mut [u8]) -> Result<Vec<Extent>, DiskError>;
    /// Writes `buf` at `off`.
    ///
    /// Errors: [`DiskError::ReadOnly`], [`DiskError::OutOfRange`], [`DiskError::Io`].
    fn write(&self, off: u64, buf: &[u8]) -> Result<(), DiskError>;
    /// Makes every completed write durable.
    ///
    /// Errors: [`DiskError::Io`].
    fn flush(&self) -> Result<(), DiskError>;
    /// Discards `[off, off + len)`: in an overlay its clusters are dropped, so the range
    /// reads as the base again.
    ///
    /// Errors: [`DiskError::ReadOnly`], [`DiskError::OutOfRange`], [`DiskError::Io`].
    fn discard(&mut self, off: u64, len: u64) -> Result<(), DiskError>;
    /// Makes `[off, off + len)` read as zeros (virtio-blk's write-zeroes). `unmap`: the
    /// range's whole clusters may be dropped to zero clusters, freeing their space (the
    /// request's `VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP`); without it they stay allocated,
    /// marked zero. Either way, never the base's bytes again: a later read of the range
    /// is zeros, reported as [`ExtentSource::Zero`] where whole clusters were zeroed.
    ///
    /// Errors: [`DiskError::ReadOnly`], [`DiskError::OutOfRange`], [`DiskError::Io`].
    fn write_zeroes(&mut self, off: u64, len: u64, unmap: bool) -> Result<(), DiskError>;
    /// Whether its base image changed under the device ([`BaseGuard`]): from then on
    /// its base reads are refused, and no (base, block) name of it may be reported.
    fn base_changed(&self) -> bool {
        false
    }
    /// Checks that its base image has not changed ([`BaseGuard`], one `fstat`), as
    /// each read does after itself: bytes read ahead are served only after it.
    ///
    /// Errors: [`DiskError::BaseChanged`].
    fn check_base(&self) -> Result<(), DiskError> {
        Ok(())
    }
    /// Where each byte of `[off, off + len)` would come from, without reading it (a read
    /// of base blocks may be served from frames instead, Satori §5.2), after checking
    /// that the base has not changed. `None`: this disk cannot say.
    ///
    /// Errors: [`DiskError::OutOfRange`], [`DiskError::BaseChanged`], [`DiskError::Io`].
    fn sources(&self, _off: u64, _len: u64) -> Result<Option<Vec<Extent>>, DiskError> {
        Ok(None)
    }
    /// Closes the disk cleanly once the device is done with it: every write made durable,
    /// then its dirty marker removed ([`OverlayDisk::close_clean`]). Nothing to do for a
    /// read-only disk.
    ///
    /// Errors: [`DiskError::Io`], [`DiskError::Marker`].
    fn close_clean(&mut self) -> Result<(), DiskError> {
        Ok(())
    }
    /// The read-only base whose blocks reads report: its id and a new descriptor of its
    /// file (memfoldd reads blocks from it to check what a frame holds).
    fn base_file(&self) -> Option<(DiskId, std::os::fd::OwnedFd)> {
        None
    }
}

fn check_range(
    path: &Path,
    op: &'static str,
    off: u64,
    len: u64,
    size: u64,
) -> Result<(), DiskError> {
    if off.checked_add(len).is_none_or(|end| end > size) {
        return Err(DiskError::OutOfRange {
            path: path.to_path_buf(),
            op,
            off,
            len,
            size,
        });
    }
    Ok(())
}

/// A read-only raw image (a data disk; or the base under an [`OverlayDisk`]).
#[derive(Debug)]
pub struct RawDisk {
    path: PathBuf,
    file: File,
    direct: bool,
    size: u64,
    id: DiskId,
    guard: BaseGuard,
}

impl RawDisk {
    /// Opens `path` read-only, with `O_DIRECT` if its file system takes it.
    ///
    /// Errors: [`DiskError::Open`].
    pub fn open(path: &Path) -> Result<RawDisk, DiskError> {
        Self::open_with(path, true)
    }

    /// [`RawDisk::open`], `O_DIRECT` only if `direct` (else buffered reads, each range
    /// dropped from the page cache after it is read: `memfold-blk --no-direct`, to compare).
    ///
    /// Errors: [`DiskError::Open`].
    pub fn open_with(path: &Path, direct: bool) -> Result<RawDisk, DiskError> {
        let open_err = |source| DiskError::Open {
            path: path.to_path_buf(),
            source,
        };
        let flags = if direct { libc::O_DIRECT } else { 0 };
        let (file, direct) = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(flags)
            .open(path)
        {
            Ok(f) if !direct => (f, false),
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                (File::open(path).map_err(open_err)?, false)
            }
            Err(e) => return Err(open_err(e)),
        };
        let st = rustix::fs::fstat(&file).map_err(|e| open_err(e.into()))?;
        let stamp = BaseStamp::of(&st);
        Ok(RawDisk {
            path: path.to_path_buf(),
            direct,
            size: st.st_size as u64,
            id: stamp.disk_id(),
            guard: BaseGuard::new(path, stamp),
            file,
        })
    }

    /// Its id (the base's, in landed reports).
    pub fn id(&self) -> DiskId {
        self.id
    }

    /// Whether it is read with `O_DIRECT`.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Checks that the file has not changed since it was opened ([`BaseGuard`]).
    ///
    /// Errors: [`DiskError::BaseChanged`].
    pub fn check_unchanged(&self) -> Result<(), DiskError> {
        self.guard.check(&self.file)
    }

    /// Reads `buf.len()` bytes at `off` (within the file): straight into `buf` when `off`
    /// and `buf` are block-aligned ([`fits_direct`]), else through an aligned bounce
    /// buffer; without `O_DIRECT`, drops the range from the page cache afterwards.
    /// Refused if the file changed since it was opened, before the read or during it.
    fn read_at(&self, off: u64, buf: &mut [u8]) -> Result<(), DiskError> {
        let len = buf.len() as u64;
        let io_err = |source| DiskError::Io {
            path: self.path.clone(),
            op: "read",
            off,
            len,
            source,
        };
        // Straight into `buf` when it can take O_DIRECT as it is (the device's own
        // buffers are aligned, `blk/read.rs`): no bounce buffer to zero and copy.
        let straight = off % BLOCK == 0 && fits_direct(buf);
        // The blocks the range covers: the range itself when straight.
        let a0 = off / BLOCK * BLOCK;
        let a1 = (off + len).div_ceil(BLOCK) * BLOCK;
        let mut bounce = (!straight).then(|| Aligned::new((a1 - a0) as usize));
        match &mut bounce {
            Some(b) => read_fully(&self.file, b.bytes_mut(), a0),
            None => read_fully(&self.file, buf, a0),
        }
        .map_err(io_err)?;
        // After the read: a change before it or during it (half old, half new bytes).
        self.guard.check(&self.file)?;
        if let Some(b) = &bounce {
            let skip = (off - a0) as usize;
            buf.copy_from_slice(&b.bytes()[skip..skip + buf.len()]);
        }
        if !self.direct {
            memfold_sys::memfd::drop_cache(self.file.as_fd(), a0, a1 - a0);
        }
        Ok(())
    }
}

impl Disk for RawDisk {
    fn size(&self) -> u64 {
        self.size
    }
    fn read_only(&self) -> bool {
        true
    }
    fn can_discard(&self) -> bool {
        false
    }
    fn read(&self, off: u64, buf: &mut [u8]) -> Result<Vec<Extent>, DiskError> {
        check_range(&self.path, "read", off, buf.len() as u64, self.size)?;
        self.read_at(off, buf)?;
        Ok(vec![Extent {
            off,
            len: buf.len() as u64,
            source: ExtentSource::Base(self.id),
        }])
    }
    fn write(&self, _off: u64, _buf: &[u8]) -> Result<(), DiskError> {
        Err(DiskError::ReadOnly {
            path: self.path.clone(),
        })
    }
    fn flush(&self) -> Result<(), DiskError> {
        Ok(())
    }
    fn discard(&mut self, _off: u64, _len: u64) -> Result<(), DiskError> {
        Err(DiskError::ReadOnly {
            path: self.path.clone(),
        })
    }
    fn write_zeroes(&mut self, _off: u64, _len: u64, _unmap: bool) -> Result<(), DiskError> {
        Err(DiskError::ReadOnly {
            path: self.path.clone(),
        })
    }
    fn base_changed(&self) -> bool {
        self.guard.changed()
    }
    fn check_base(&self) -> Result<(), DiskError> {
        self.check_unchanged()
    }
    fn sources(&self, off: u64, len: u64) -> Result<Option<Vec<Extent>>, DiskError> {
        check_range(&self.path, "read", off, len, self.size)?;
        self.check_unchanged()?;
        Ok(Some(vec![Extent {
            off,
            len,
            source: ExtentSource::Base(self.id),
        }]))
    }
    fn base_file(&self) -> Option<(DiskId, std::os::fd::OwnedFd)> {
        let f = self.file.try_clone().ok()?;
        Some((self.id, f.into()))
    }
}

/// A per-guest qcow2 overlay over a read-only raw base (created with
/// `qemu-img create -f qcow2 -b BASE -F raw OVERLAY`, which QEMU opens as well), through
/// imago. Reads of clusters the overlay does not hold are served from the base by this
/// crate's own [`RawDisk`] and reported as base blocks; imago serves the rest and writes
/// (copy-on-write of partial clusters from the base included).
pub struct OverlayDisk {
    path: PathBuf,
    base: RawDisk,
    overlay: FormatAccess<ImagoFile>,
    /// The overlay's file, the one open file imago serves (it has duplicates of this
    /// descriptor): to drop its ranges from the page cache when its I/O is buffered, and
    /// to say how much room it had when a write fails.
    cache_handle: File,
    /// Whether the overlay's file is open with `O_DIRECT`.
    direct: bool,
    /// Fails every flush once a sync of the overlay failed ([`sync_latch`]).
    sync_latch: sync_latch::SyncLatch,
    /// Closed cleanly ([`OverlayDisk::close_clean`]): its dirty marker is gone, so writes
    /// are refused.
    closed: bool,
}

impl OverlayDisk {
    /// Opens the overlay `overlay` (read-write) over the raw base `base` (read-only),
    /// each file once, after checking, with neither file written, that the overlay is over
    /// that base (as [`check_overlay`], on the very file and instance served). Nothing the
    /// overlay's header names is opened: the backing image is the base's own descriptor
    /// (the one its [`BaseGuard`] watches), and an overlay that needs an external data file
    /// is refused.
    ///
    /// The overlay is locked for the disk's life (an OFD write lock on the whole file, as
    /// QEMU's own locks conflict with), and the base is checked against the one the
    /// overlay was first served over, recorded next to it ([`stamp_path`]). An overlay its
    /// last device did not close cleanly ([`dirty_path`] exists) is first repaired with
    /// `qemu-img check -r all` (`repair.rs`); the marker is made before any write.
    ///
    /// Errors: [`DiskError::OverlayMismatch`], [`DiskError::InUse`],
    /// [`DiskError::BaseChangedSinceStamp`], [`DiskError::Stamp`],
    /// [`DiskError::Unrepaired`], [`DiskError::Marker`], [`DiskError::Open`] (either image).
    pub fn open(base: &Path, overlay: &Path) -> Result<OverlayDisk, DiskError> {
        Self::open_with(base, overlay, true)
    }

    /// [`OverlayDisk::open`], `O_DIRECT` only if `direct` (else buffered, the ranges read
    /// or flushed dropped from the page cache afterwards).
    ///
    /// Errors: as [`OverlayDisk::open`].
    pub fn open_with(base: &Path, overlay: &Path, direct: bool) -> Result<OverlayDisk, DiskError> {
        Self::open_repairing_with(base, overlay, direct, &["qemu-img".as_ref()])
    }

    /// [`OverlayDisk::open_with`], a repair run by the command words `qemu_img` (tests).
    fn open_repairing_with(
        base: &Path,
        overlay: &Path,
        direct: bool,
        qemu_img: &[&std::ffi::OsStr],
    ) -> Result<OverlayDisk, DiskError> {
        let raw = RawDisk::open_with(base, direct)?;
        // Before the lock, which qemu-img's own locks conflict with.
        repair::repair_if_dirty(base, overlay, qemu_img)?;
        let (file, direct) = open::open_overlay_file(overlay, direct)?;
        let (q, verdict) = open::served(&raw, &file, overlay, direct)?;
        // The base could have changed since it was opened.
        raw.check_unchanged()?;
        if verdict == stamp::Verdict::Write {
            match stamp::write(&raw.guard.stamp(), &file, overlay) {
                // A folder the device may not write (a pre-provisioned image, a confining
                // profile that allows the image alone): served as before stamps existed,
                // said once. Anything else (EIO, a full disk) refuses.
                Err(DiskError::Stamp { stamp, source, .. })
                    if matches!(
                        source.kind(),
                        std::io::ErrorKind::PermissionDenied
                            | std::io::ErrorKind::ReadOnlyFilesystem
                    ) =>
                {
                    tracing::warn!(
                        "cannot record overlay {}'s base in {} ({source}): served without it, \
                         so a base changed before a restart is not caught",
                        overlay.display(),
                        stamp.display()
                    );
                }
                r => r?,
            }
        }
        Ok(OverlayDisk {
            path: overlay.to_path_buf(),
            base: raw,
            overlay: q,
            cache_handle: file,
            direct,
            sync_latch: sync_latch::SyncLatch::default(),
            closed: false,
        })
    }

    /// Whether both images are read and written with `O_DIRECT`.
    pub fn direct(&self) -> bool {
        self.direct && self.base.direct()
    }

    fn io_err(
        &self,
        op: &'static str,
        off: u64,
        len: u64,
    ) -> impl FnOnce(std::io::Error) -> DiskError + '_ {
        move |source| DiskError::Io {
            path: self.path.clone(),
            op,
            off,
            len,
            source,
        }
    }

    /// `e` with what room the overlay's file had: a full file system or a file size
    /// limit shows as `ENOSPC`/`EFBIG`, or as `EINVAL` when an `O_DIRECT` write was cut
    /// short at the limit and its rest is unaligned.
    fn with_room(&self, e: std::io::Error) -> std::io::Error {
        let size = rustix::fs::fstat(&self.cache_handle).map_or(0, |s| s.st_size as u64);
        let free = rustix::fs::fstatvfs(&self.cache_handle).map_or(0, |s| s.f_bavail * s.f_frsize);
        let limit = rustix::process::getrlimit(rustix::process::Resource::Fsize)
            .current
            .map_or("none".to_string(), |l| format!("{l} bytes"));
        std::io::Error::new(
            e.kind(),
            format!("{e} (the overlay file has {size} bytes, its file system {free} bytes free; file size limit {limit})"),
        )
    }

    /// imago's read of `buf` at `off`, straight into `buf`: imago checks the offset,
    /// length and buffer against the file's `O_DIRECT` alignment itself and reads
    /// through a padded buffer of its own only when one is not aligned (imago 0.2
    /// `StorageExt::readv`); the device's own buffer is (`blk/read.rs`).
    fn imago_read(&self, off: u64, buf: &mut [u8]) -> Result<(), DiskError> {
        let len = buf.len() as u64;
        self.overlay
            .read(buf, off)
            .map_err(self.io_err("read", off, len))
    }
}

impl OverlayDisk {
    /// Where each byte of `[off, off + len)` comes from, piece by piece as the overlay maps
    /// it (not merged), each with the overlay file's offset of its data when the overlay
    /// holds it.
    ///
    /// Errors: [`DiskError::OutOfRange`], [`DiskError::Io`].
    fn mapping(&self, off: u64, len: u64) -> Result<Vec<(Extent, Option<u64>)>, DiskError> {
        check_range(&self.path, "read", off, len, self.size())?;
        let mut out = Vec::new();
        let mut at = 0u64;
        while at < len {
            let (m, n) = self
                .overlay
                .get_shallow_mapping(off + at, len - at)
                .map_err(self.io_err("read", off + at, len - at))?;
            let n = n.clamp(1, len - at);
            let (source, host_off) = match m {
                ShallowMapping::Indirect { .. } => (ExtentSource::Base(self.base.id()), None),
                ShallowMapping::Raw { offset, .. } => (ExtentSource::Overlay, Some(offset)),
                ShallowMapping::Zero { .. } | ShallowMapping::Eof { .. } => {
                    (ExtentSource::Zero, None)
                }
                _ => (ExtentSource::Overlay, None),
            };
            let e = Extent {
                off: off + at,
                len: n,
                source,
            };
            out.push((e, host_off));
            at += n;
        }
        Ok(out)
    }
}

/// Consecutive extents of one source as one.
fn merge(pieces: impl Iterator<Item = Extent>) -> Vec<Extent> {
    let mut ext: Vec<Extent> = Vec::new();
    for p in pieces {
        match ext.last_mut() {
            Some(e) if e.source == p.source && e.off + e.len == p.off => e.len += p.len,
            _ => ext.push(p),
        }
    }
    ext
}

impl Disk for OverlayDisk {
    fn size(&self) -> u64 {
        self.overlay.size()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn can_discard(&self) -> bool {
        true
    }
    fn sources(&self, off: u64, len: u64) -> Result<Option<Vec<Extent>>, DiskError> {
        let ext = merge(self.mapping(off, len)?.into_iter().map(|p| p.0));
        if ext
            .iter()
            .any(|e| matches!(e.source, ExtentSource::Base(_)))
        {
            self.base.check_unchanged()?;
        }
        Ok(Some(ext))
    }
    fn base_file(&self) -> Option<(DiskId, std::os::fd::OwnedFd)> {
        self.base.base_file()
    }
    fn read(&self, off: u64, buf: &mut [u8]) -> Result<Vec<Extent>, DiskError> {
        let pieces = self.mapping(off, buf.len() as u64)?;
        for &(e, host_off) in &pieces {
            let dst = &mut buf[(e.off - off) as usize..(e.off - off + e.len) as usize];
            match e.source {
                ExtentSource::Base(_) => self.base.read_at(e.off, dst)?,
                ExtentSource::Zero => dst.fill(0),
                ExtentSource::Overlay => {
                    self.imago_read(e.off, dst)?;
                    if let (false, Some(h)) = (self.direct, host_off) {
                        memfold_sys::memfd::drop_cache(self.cache_handle.as_fd(), h, e.len);
                    }
                }
            }
        }
        Ok(merge(pieces.into_iter().map(|p| p.0)))
    }
    /// Writes `buf` at `off` into the overlay, then writes imago's cached metadata (L2
    /// tables, refcounts) to the file: a write completed to the guest survives a kill of
    /// the device (which the guest does not see and so does not repeat the write), not
    /// only a flush. Refused when the base changed (a partial cluster's copy-on-write
    /// reads it).
    fn write(&self, off: u64, buf: &[u8]) -> Result<(), DiskError> {
        check_range(&self.path, "write", off, buf.len() as u64, self.size())?;
        self.check_open("write", off, buf.len() as u64)?;
        self.base.check_unchanged()?;
        let mut b = Aligned::new(buf.len());
        b.bytes_mut().copy_from_slice(buf);
        let src = b.bytes();
        let len = buf.len() as u64;
        self.overlay
            .write(src, off)
            .map_err(|e| self.io_err("write", off, len)(self.with_room(e)))?;
        self.overlay
            .flush()
            .map_err(self.io_err("write (its metadata)", off, len))
    }
    fn flush(&self) -> Result<(), DiskError> {
        self.overlay.flush().map_err(self.io_err("flush", 0, 0))?;
        self.sync_latch
            .sync(|| self.overlay.sync())
            .map_err(self.io_err("flush", 0, 0))?;
        if !self.direct {
            // Written back by the sync: clean pages, which DONTNEED drops.
            memfold_sys::memfd::drop_cache(self.cache_handle.as_fd(), 0, 0);
        }
        Ok(())
    }
    /// Drops the range's clusters, then writes imago's metadata (as [`Disk::write`]).
    /// Refused when the base changed (the range would read as the changed base).
    fn discard(&mut self, off: u64, len: u64) -> Result<(), DiskError> {
        check_range(&self.path, "discard", off, len, self.size())?;
        self.check_open("discard", off, len)?;
        self.base.check_unchanged()?;
        let path = self.path.clone();
        let err = |source| DiskError::Io {
            path,
            op: "discard",
            off,
            len,
            source,
        };
        self.overlay.discard_to_backing(off, len).map_err(err)?;
        self.overlay
            .flush()
            .map_err(self.io_err("discard (its metadata)", off, len))
    }
    /// Zero clusters where the range covers whole clusters (dropped first with `unmap`),
    /// zeros written into the partial ones at its ends (which copies their rest from the
    /// base, as a write does), then imago's metadata written (as [`Disk::write`]).
    /// Refused when the base changed (that copy reads it).
    fn write_zeroes(&mut self, off: u64, len: u64, unmap: bool) -> Result<(), DiskError> {
        check_range(&self.path, "write zeroes", off, len, self.size())?;
        self.check_open("write zeroes", off, len)?;
        self.base.check_unchanged()?;
        let r = if unmap {
            self.overlay.discard_to_zero(off, len)
        } else {
            self.overlay.write_zeroes(off, len)
        };
        r.map_err(|e| self.io_err("write zeroes", off, len)(self.with_room(e)))?;
        self.overlay
            .flush()
            .map_err(self.io_err("write zeroes (its metadata)", off, len))
    }
    fn base_changed(&self) -> bool {
        self.base.base_changed()
    }
    fn check_base(&self) -> Result<(), DiskError> {
        self.base.check_unchanged()
    }
    fn close_clean(&mut self) -> Result<(), DiskError> {
        OverlayDisk::close_clean(self)
    }
}

/// Shares one base's bytes between several readers in tests.
pub type SharedDisk = Arc<dyn Disk>;

/// Makes `overlay` a new qcow2 image over the raw base `base` (`qemu-img create -f qcow2
/// -b BASE -F raw OVERLAY`): a per-guest copy-on-write disk QEMU can open too (Satori
/// §4.1).
///
/// A stamp and a dirty marker left by an earlier overlay at that path ([`stamp_path`],
/// [`dirty_path`]) are removed once it is made: the new overlay holds nothing, its first
/// open records its base afresh and needs no repair. A create that fails keeps both.
///
/// Errors: [`DiskError::Open`] naming the overlay: `qemu-img` missing or failing (its
/// message), or the old stamp or marker not removable.
pub fn create_overlay(base: &Path, overlay: &Path) -> Result<(), DiskError> {
    let fail = |source: std::io::Error| DiskError::Open {
        path: overlay.to_path_buf(),
        source,
    };
    let remove = |old: PathBuf| match std::fs::remove_file(old) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(fail(e)),
        _ => Ok(()),
    };
    let out = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-b"])
        .arg(base)
        .args(["-F", "raw"])
        .arg(overlay)
        .output()
        .map_err(|e| fail(std::io::Error::new(e.kind(), format!("qemu-img: {e}"))))?;
    if !out.status.success() {
        return Err(fail(std::io::Error::other(format!(
            "qemu-img create: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))));
    }
    // Only once made: a failed create (a device serving the old file) keeps both. A stamp
    // a crash leaves here names this file (truncated in place): a changed base is refused.
    remove(stamp_path(overlay))?;
    remove(dirty_path(overlay))
}

#[cfg(test)]
mod tests;
