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

use std::fs::File;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use imago::file::File as ImagoFile;
use imago::format::drivers::FormatDriverInstance;
use imago::qcow2::Qcow2;
use imago::raw::Raw;
use imago::{DenyImplicitOpenGate, FormatAccess, FormatDriverBuilder, StorageOpenOptions};

use super::{DiskError, Mismatch, RawDisk};

/// The overlay at `path` opened read-write, once, with `O_DIRECT` if `direct` and its file
/// system takes it (else buffered); and whether it is `O_DIRECT`.
///
/// Errors: [`DiskError::Open`] naming the overlay.
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
    opened.map_err(|source| DiskError::Open {
        path: path.to_path_buf(),
        source,
    })
}

/// The instance served for the overlay open as `file` (`path`, `O_DIRECT` if `direct`)
/// over `base`: parsed read-only and checked ([`check`]) with nothing written, then parsed
/// read-write from the same open file, over `base`'s own descriptor, with nothing implicit
/// opened, and checked again.
///
/// Errors: [`DiskError::OverlayMismatch`]; [`DiskError::Open`] naming the overlay (not
/// qcow2, unreadable, or a reference in its header not given explicitly) or the base.
pub(super) fn served(
    base: &RawDisk,
    file: &File,
    path: &Path,
    direct: bool,
) -> Result<FormatAccess<ImagoFile>, DiskError> {
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
    drop(q);

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
    Ok(FormatAccess::new(q))
}

/// Checks, without writing either file, that the qcow2 `overlay` is over the raw `base`:
/// its header's backing file is `base` (the same file: device and inode, the name
/// resolved against the overlay's folder as QEMU does), its backing format is `raw`, it
/// has no external data file, and its virtual size is the base's. Each file is opened
/// once, read-only, and nothing the header names is opened.
///
/// Errors: [`DiskError::OverlayMismatch`]; [`DiskError::Open`] (either file unreadable,
/// the overlay not qcow2).
pub fn check_overlay(base: &Path, overlay: &Path) -> Result<(), DiskError> {
    let b = File::open(base).map_err(open_err(base))?;
    let m = b.metadata().map_err(open_err(base))?;
    let base_id = BaseId {
        path: base,
        dev: m.dev(),
        ino: m.ino(),
        size: m.len(),
    };
    let f = File::open(overlay).map_err(open_err(overlay))?;
    let f = ImagoFile::from_open_file(f, StorageOpenOptions::new().write(false).filename(overlay))
        .map_err(open_err(overlay))?;
    let q = Qcow2::<ImagoFile>::builder(f)
        .write(false)
        .backing(None)
        .data_file(None)
        .open(DenyImplicitOpenGate::default())
        .map_err(open_err(overlay))?;
    check(&q, &base_id, overlay)
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
