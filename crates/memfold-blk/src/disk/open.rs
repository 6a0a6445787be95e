//! Opening a qcow2 overlay over its raw base with nothing its header names ever opened
//! (issue 16, "bad input"; found by a read-only review).
//!
//! A qcow2 header names files: a backing file and, optionally, an external data file
//! that holds the guest's clusters. Whoever can put a file at the overlay's path chooses
//! those names, and imago left to itself opens them (the data file read-write, its name
//! resolved against the overlay's folder). The device used to check the overlay by path
//! and then open it by path again, so an overlay swapped in between (a rename, a symlink)
//! was served unchecked, with whatever data file it named: another guest's disk read and
//! written as this guest's. The base, too, was opened by path once for the check, once
//! for this crate's reads and once for imago's.
//!
//! Now each file is opened once, by the device, and imago is handed only those
//! descriptors:
//!
//! - the base is [`RawDisk`]'s descriptor, the one its [`super::BaseGuard`] watches
//!   (a duplicate of it: the same open file, same offset-free `pread`s); imago gets it as
//!   the backing image, explicitly, and the header's backing name is only compared with
//!   it (device and inode), never opened;
//! - the overlay's one descriptor is parsed read-only first and checked ([`check`]:
//!   backing file and format, no external data file, size), with nothing written; the
//!   instance then served is parsed read-write from the same open file and checked again,
//!   so a header rewritten in place between the two is refused too;
//! - imago opens both with [`DenyImplicitOpenGate`]: a reference the header makes that
//!   was not given explicitly fails the open instead of opening a file.
//!
//! The overlay is locked before anything reads it (`lock`): two writers of one qcow2
//! file (a second memfold-blk started by mistake, a `qemu-img` on the live file) each
//! keep their own cache of its metadata and allocate the same free clusters for
//! different data. Before the read-write parse the base is checked against the one the
//! overlay was first served over (`stamp.rs`).

use std::fs::File;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use imago::file::File as ImagoFile;
use imago::format::drivers::FormatDriverInstance;
use imago::qcow2::Qcow2;
use imago::raw::Raw;
use imago::{
    DenyImplicitOpenGate, FormatAccess, FormatDriverBuilder, ShallowMapping, StorageOpenOptions,
};

use super::stamp::{self, Verdict};
use super::{BaseStamp, DiskError, Mismatch, RawDisk};

/// Takes an exclusive lock of the whole of the open file `file` (`path`) for as long as
/// its open file description lives (every duplicate of its descriptor closed).
///
/// An OFD lock (`F_OFD_SETLK`, `F_WRLCK`), not `flock`: QEMU and `qemu-img` lock images
/// with OFD locks on a few bytes, which a whole-file write lock conflicts with (`flock`
/// locks are another table that `fcntl` locks never meet on a local file system). Not a
/// POSIX lock (what `rustix::fs::fcntl_lock` takes): it belongs to the process, so a
/// second open in the same process would not conflict, and closing any descriptor of the
/// file (imago's duplicates, a check that opens it) would drop it. rustix offers no OFD
/// lock, hence `libc`.
///
/// A conflict is retried for `LOCK_WAIT`: a fork elsewhere in this process (a thread
/// spawning a program) holds a copy of every descriptor, a closed overlay's too, until
/// its `exec`.
///
/// Errors: [`DiskError::InUse`] (another open file description holds a lock);
/// [`DiskError::Open`] (any other failure).
fn lock(file: &File, path: &Path) -> Result<(), DiskError> {
    use std::os::fd::AsRawFd;
    // SAFETY: all-zero is a valid `struct flock` (plain integers).
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = libc::F_WRLCK as _;
    l.l_whence = libc::SEEK_SET as _;
    // l_start 0, l_len 0: the whole file, however it grows; l_pid 0, as OFD locks need.
    let start = std::time::Instant::now();
    loop {
        // SAFETY: `file` is an open descriptor for the call; F_OFD_SETLK only reads `l`,
        // which lives across it.
        let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &l) };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN | libc::EACCES) if start.elapsed() < LOCK_WAIT => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Some(libc::EAGAIN | libc::EACCES) => {
                return Err(DiskError::InUse {
                    path: path.to_path_buf(),
                })
            }
            _ => {
                return Err(DiskError::Open {
                    path: path.to_path_buf(),
                    source: std::io::Error::new(e.kind(), format!("lock (F_OFD_SETLK): {e}")),
                })
            }
        }
    }
}

/// Waits for no open file description to hold a lock on the overlay open as `file` (at
/// `path`) that conflicts with the device's (`lock`), without taking one: before
/// `qemu-img` repairs it (`repair.rs`), whose own locks would conflict with the device's.
/// Asked with `F_OFD_GETLK`, retried for `LOCK_WAIT` as `lock` is.
///
/// Errors: [`DiskError::InUse`] (a device, a QEMU or a qemu-img holds it);
/// [`DiskError::Open`] (any other failure).
pub(super) fn wait_unlocked(file: &File, path: &Path) -> Result<(), DiskError> {
    use std::os::fd::AsRawFd;
    let start = std::time::Instant::now();
    loop {
        // SAFETY: all-zero is a valid `struct flock` (plain integers).
        let mut l: libc::flock = unsafe { std::mem::zeroed() };
        l.l_type = libc::F_WRLCK as _;
        l.l_whence = libc::SEEK_SET as _;
        // SAFETY: `file` is an open descriptor for the call; F_OFD_GETLK writes `l`, which
        // lives across it.
        let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut l) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            return Err(open_err(path)(std::io::Error::new(
                e.kind(),
                format!("lock (F_OFD_GETLK): {e}"),
            )));
        }
        if i32::from(l.l_type) == libc::F_UNLCK {
            return Ok(());
        }
        if start.elapsed() >= LOCK_WAIT {
            return Err(DiskError::InUse {
                path: path.to_path_buf(),
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// How long a lock held by another open of the overlay is waited for.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The overlay at `path` opened read-write, once, with `O_DIRECT` if `direct` and its file
/// system takes it (else buffered), and locked (`lock`) for the life of the returned
/// file and its duplicates; and whether it is `O_DIRECT`.
///
/// Errors: [`DiskError::InUse`]; [`DiskError::Open`] naming the overlay.
pub(super) fn open_overlay_file(path: &Path, direct: bool) -> Result<(File, bool), DiskError> {
    let open = |flags| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(flags)
            .open(path)
    };
    let opened = match direct {
        true => match open(libc::O_DIRECT) {
            Ok(f) => Ok((f, true)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => open(0).map(|f| (f, false)),
            Err(e) => Err(e),
        },
        false => open(0).map(|f| (f, false)),
    };
    let (file, direct) = opened.map_err(|source| DiskError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    lock(&file, path)?;
    Ok((file, direct))
}

/// The instance served for the overlay open as `file` (`path`, `O_DIRECT` if `direct`)
/// over `base`: parsed read-only and checked ([`check`]) with nothing written, then parsed
/// read-write from the same open file, over `base`'s own descriptor, with nothing implicit
/// opened, and checked again. Between the two the base is checked against the overlay's
/// stamp file; what to do with it once served is returned.
///
/// The overlay's dirty marker is made just before the read-write parse (`repair.rs`).
///
/// Errors: [`DiskError::OverlayMismatch`], [`DiskError::BaseChangedSinceStamp`],
/// [`DiskError::Stamp`], [`DiskError::Marker`]; [`DiskError::Open`] naming the overlay
/// (not qcow2, unreadable, or a reference in its header not given explicitly) or the base.
pub(super) fn served(
    base: &RawDisk,
    file: &File,
    path: &Path,
    direct: bool,
) -> Result<(FormatAccess<ImagoFile>, Verdict), DiskError> {
    let base_st = rustix::fs::fstat(&base.file).map_err(|e| DiskError::Open {
        path: base.path.clone(),
        source: e.into(),
    })?;
    let base_id = BaseId {
        path: &base.path,
        dev: base_st.st_dev,
        ino: base_st.st_ino,
        size: base.size,
    };
    let opts = StorageOpenOptions::new().direct(direct).filename(path);

    // First read-only: a mismatch is refused with the overlay unwritten (a writable open
    // writes: imago's O_DIRECT alignment probe rewrites a sector, its header load clears
    // autoclear bits).
    let ro = ImagoFile::from_open_file(dup(file, path)?, opts.clone().write(false))
        .map_err(open_err(path))?;
    let q = Qcow2::<ImagoFile>::builder(ro)
        .write(false)
        .backing(None)
        .data_file(None)
        .open(DenyImplicitOpenGate::default())
        .map_err(open_err(path))?;
    check(&q, &base_id, path)?;
    let q = FormatAccess::new(q);
    let verdict = stamp::check(&base.guard.stamp(), &base.path, file, path, || {
        holds_nothing(&q, path)
    })?;
    drop(q);
    // Before the read-write parse, which writes (see above).
    super::repair::mark(path)?;

    let base_file = ImagoFile::from_open_file(
        dup(&base.file, &base.path)?,
        StorageOpenOptions::new()
            .direct(base.direct)
            .write(false)
            .filename(&base.path),
    )
    .map_err(open_err(&base.path))?;
    let backing = Raw::<ImagoFile>::builder(base_file)
        .write(false)
        .open(DenyImplicitOpenGate::default())
        .map_err(open_err(&base.path))?;
    let rw =
        ImagoFile::from_open_file(dup(file, path)?, opts.write(true)).map_err(open_err(path))?;
    // No data file given: one the header asks for goes to the gate, which refuses it.
    let q = Qcow2::<ImagoFile>::builder(rw)
        .write(true)
        .backing(Some(FormatAccess::new(backing)))
        .open(DenyImplicitOpenGate::default())
        .map_err(open_err(path))?;
    check(&q, &base_id, path)?;
    Ok((FormatAccess::new(q), verdict))
}

/// Whether the overlay `q` (parsed without its backing file) has no cluster of its own:
/// every range unallocated, to be read from the backing file.
///
/// Errors: [`DiskError::Open`] naming the overlay (its tables unreadable).
fn holds_nothing(q: &FormatAccess<ImagoFile>, path: &Path) -> Result<bool, DiskError> {
    let size = q.size();
    let mut at = 0u64;
    while at < size {
        let (m, n) = q
            .get_shallow_mapping(at, size - at)
            .map_err(open_err(path))?;
        match m {
            ShallowMapping::Zero {
                explicit: false, ..
            } => {}
            ShallowMapping::Eof { .. } => break,
            _ => return Ok(false),
        }
        at += n.max(1);
    }
    Ok(true)
}

/// Checks, without writing either file, that the qcow2 `overlay` is over the raw `base`:
/// its header's backing file is `base` (the same file: device and inode, the name
/// resolved against the overlay's folder as QEMU does), its backing format is `raw`, it
/// has no external data file, and its virtual size is the base's; and that the base is
/// the one the overlay was first served over, if it was ([`super::stamp_path`]). Each file
/// is opened once, read-only, and nothing the header names is opened.
///
/// Errors: [`DiskError::OverlayMismatch`], [`DiskError::BaseChangedSinceStamp`],
/// [`DiskError::Stamp`]; [`DiskError::Open`] (either file unreadable, the overlay not
/// qcow2).
pub fn check_overlay(base: &Path, overlay: &Path) -> Result<(), DiskError> {
    checked_overlay(base, overlay).map(drop)
}

/// [`check_overlay`], returning the overlay's file (read-only) that was checked: what is
/// done with it next is done to that file, not to whatever is at the path by then.
///
/// Errors: as [`check_overlay`].
pub(super) fn checked_overlay(base: &Path, overlay: &Path) -> Result<File, DiskError> {
    let b = File::open(base).map_err(open_err(base))?;
    let st = rustix::fs::fstat(&b).map_err(|e| open_err(base)(e.into()))?;
    let base_id = BaseId {
        path: base,
        dev: st.st_dev,
        ino: st.st_ino,
        size: st.st_size as u64,
    };
    let file = File::open(overlay).map_err(open_err(overlay))?;
    let f = ImagoFile::from_open_file(
        dup(&file, overlay)?,
        StorageOpenOptions::new().write(false).filename(overlay),
    )
    .map_err(open_err(overlay))?;
    let q = Qcow2::<ImagoFile>::builder(f)
        .write(false)
        .backing(None)
        .data_file(None)
        .open(DenyImplicitOpenGate::default())
        .map_err(open_err(overlay))?;
    check(&q, &base_id, overlay)?;
    let q = FormatAccess::new(q);
    stamp::check(&BaseStamp::of(&st), base, &file, overlay, || {
        holds_nothing(&q, overlay)
    })?;
    Ok(file)
}

/// The open base an overlay is checked against.
struct BaseId<'a> {
    /// Its path (for messages).
    path: &'a Path,
    /// Device of the open file.
    dev: u64,
    /// Inode of the open file.
    ino: u64,
    /// Size, bytes.
    size: u64,
}

/// Checks one parsed instance `q` of the overlay at `overlay` against the open base:
/// no external data file, the header's backing file is the base's file (the name resolved
/// against the overlay's folder; only looked up, never opened), backing format `raw`,
/// virtual size the base's.
///
/// Errors: [`DiskError::OverlayMismatch`].
fn check(q: &Qcow2<ImagoFile>, base: &BaseId<'_>, overlay: &Path) -> Result<(), DiskError> {
    let mismatch = |why| DiskError::OverlayMismatch {
        overlay: overlay.to_path_buf(),
        base: base.path.to_path_buf(),
        why,
    };
    if q.requires_external_data_file() {
        return Err(mismatch(Mismatch::DataFile));
    }
    let Some(named) = q.implicit_backing_file().cloned() else {
        return Err(mismatch(Mismatch::NoBacking));
    };
    let resolved = overlay
        .parent()
        .map_or_else(|| PathBuf::from(&named), |d| d.join(&named));
    match std::fs::metadata(&resolved) {
        Ok(m) if (m.dev(), m.ino()) == (base.dev, base.ino) => {}
        Ok(m) => {
            return Err(mismatch(Mismatch::BackingFile {
                named,
                resolved: format!(
                    "{}: device {} inode {}, the base device {} inode {}",
                    resolved.display(),
                    m.dev(),
                    m.ino(),
                    base.dev,
                    base.ino
                ),
            }))
        }
        Err(e) => {
            return Err(mismatch(Mismatch::BackingFile {
                named,
                resolved: format!("{}: {e}", resolved.display()),
            }))
        }
    }
    let format = q.implicit_backing_format().cloned();
    if format.as_deref() != Some("raw") {
        return Err(mismatch(Mismatch::BackingFormat(format)));
    }
    if q.size() != base.size {
        return Err(mismatch(Mismatch::Size {
            base: base.size,
            overlay: q.size(),
        }));
    }
    Ok(())
}

/// A new descriptor of the open file `f` (`dup`: the same open file, flags and all).
fn dup(f: &File, path: &Path) -> Result<File, DiskError> {
    f.try_clone().map_err(open_err(path))
}

/// [`DiskError::Open`] of `path`, from an error.
fn open_err(path: &Path) -> impl FnOnce(std::io::Error) -> DiskError + '_ {
    move |source| DiskError::Open {
        path: path.to_path_buf(),
        source,
    }
}
