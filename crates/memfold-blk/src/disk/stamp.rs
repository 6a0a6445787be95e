//! The base an overlay was first served over, kept next to it ([`stamp_path`]: a base
//! rewritten in place between two runs of the device is refused at the next open instead
//! of being served under clusters copied from its old bytes (found by a read-only review).
//!
//! [`super::BaseGuard`] sees a change while the device runs, but only in memory: a device
//! restarted after it took the changed base as it found it, and served the clusters the
//! guest had written (their copy-on-write filled from the old base) beside the new base's
//! bytes, a mix, with no error. Now the first open of an overlay records its base's
//! device, inode, size and mtime (ns), and the overlay file's own device, inode and birth
//! time (devices kept for the reader, not compared: a reboot may renumber them), in a
//! small file next to it (written to a temporary file, synced, renamed, the
//! folder synced). Every later open compares the base with it before the overlay is opened
//! for writing (`check`); if the base differs the open is refused
//! ([`DiskError::BaseChangedSinceStamp`]) — unless the overlay is another file than the
//! one stamped and holds no cluster of its own (an overlay made anew at that path over a
//! rebuilt base, as `memfold-vm`'s launcher does for each run): nothing of it can mix,
//! and its stamp is written afresh. A device that saw the base change while it ran needs
//! nothing more: the recorded stamp already differs, so a restart refuses too (even with
//! nothing written yet: the running guest's page cache holds the old base's bytes).
//!
//! Not ctime ([`BaseStamp::content`], as for the running guard): chmod, chown,
//! `chattr +i`, an xattr or a hard link change it without changing a byte, and an
//! operator protecting a base would have its guests' disks refused for good. mtime moves
//! with every write; only a deliberate `utimensat` back to the recorded value (or a write
//! within one timestamp tick of the recorded one, as for the guard) hides a write in
//! place. An overlay first
//! served before this stamp existed is stamped with its base as found then.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::{BaseStamp, DiskError};

/// First line of a stamp file.
const MAGIC: &str = "memfold-blk base stamp 1";

/// Most bytes a stamp file is read of (one has about 200).
const STAMP_MAX: u64 = 4096;

/// Opens `path` with `opts`, `O_NOFOLLOW | O_NONBLOCK`, and only if it is a regular file:
/// a link, FIFO, device or socket at a name the device keeps next to an overlay (its
/// stamp, its dirty marker, their temporary files) is refused at once, neither followed
/// nor waited on (a FIFO's open or read would hold the device's start for good, a link to
/// `/dev/zero` be read until memory runs out).
///
/// Errors: the open's or `fstat`'s; [`std::io::ErrorKind::InvalidInput`] saying what the
/// file is when it is not a regular one.
pub(super) fn open_regular(opts: &mut OpenOptions, path: &Path) -> std::io::Result<File> {
    let not_regular = |t: std::fs::FileType| {
        let what = memfold_sys::files::kind_of(&t);
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{what}, not a regular file: refused (neither followed nor waited on)"),
        )
    };
    let f = match opts
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        // ELOOP for a link, ENXIO for a FIFO no one reads: said as what is there.
        Err(e) => match std::fs::symlink_metadata(path) {
            Ok(m) if !m.is_file() => return Err(not_regular(m.file_type())),
            _ => return Err(e),
        },
    };
    let t = f.metadata()?.file_type();
    if !t.is_file() {
        return Err(not_regular(t));
    }
    Ok(f)
}

/// A new, empty regular file at `path`, to write: the name removed first (whatever was
/// there), then created with `O_EXCL` ([`open_regular`]'s flags too). Truncating what is
/// there instead would empty the file a hard link planted at the name points to (the
/// base, say): `O_NOFOLLOW` stops symbolic links only, and `O_TRUNC` acts at the open,
/// before any check. A file put back at the name in between fails the create.
///
/// Errors: the removal's (other than not found) or the create's.
pub(super) fn create_fresh(path: &Path) -> std::io::Result<File> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    open_regular(OpenOptions::new().write(true).create_new(true), path)
}

/// The text of the stamp file at `path`, at most [`STAMP_MAX`] bytes of it; `None` if
/// there is none.
///
/// Errors: [`open_regular`]'s; [`std::io::ErrorKind::InvalidData`] when longer or not
/// UTF-8.
fn read_stamp(path: &Path) -> std::io::Result<Option<String>> {
    let f = match open_regular(OpenOptions::new().read(true), path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        r => r?,
    };
    let mut b = Vec::new();
    f.take(STAMP_MAX + 1).read_to_end(&mut b)?;
    let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    if b.len() as u64 > STAMP_MAX {
        return Err(bad(format!("more than {STAMP_MAX} bytes: not a stamp")));
    }
    String::from_utf8(b)
        .map(Some)
        .map_err(|_| bad("not UTF-8: not a stamp".into()))
}

/// The stamp file of the overlay at `overlay`: `<overlay>.memfold-base`. Removing it makes
/// the next open accept the base as it is then (docs/blk-faults.md: only when the base's
/// bytes are known to be those the overlay was made over, or the overlay holds nothing).
pub fn stamp_path(overlay: &Path) -> PathBuf {
    let mut s = overlay.as_os_str().to_os_string();
    s.push(".memfold-base");
    PathBuf::from(s)
}

/// What a stamp file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Recorded {
    /// The base: device, inode, size, mtime (ns since the epoch).
    base: (u64, u64, u64, i128),
    /// The overlay file: device, inode, birth time (ns; `None`: not known).
    overlay: (u64, u64, Option<i128>),
}

/// What an open does with the stamp file once the overlay is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// It names this base and this overlay file: nothing.
    Same,
    /// None yet, another overlay file's, or a stale one over an overlay holding nothing:
    /// written.
    Write,
}

fn base_of(s: &BaseStamp) -> (u64, u64, u64, i128) {
    let (ino, size, mtime) = s.content();
    (s.dev, ino, size, mtime)
}

/// The overlay open as `file`: device, inode, birth time if its file system keeps one.
fn overlay_of(file: &File) -> std::io::Result<(u64, u64, Option<i128>)> {
    let m = file.metadata()?;
    let born = m
        .created()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos() as i128);
    Ok((m.dev(), m.ino(), born))
}

impl Recorded {
    fn text(&self) -> String {
        let (d, i, s, m) = self.base;
        let (od, oi, ob) = self.overlay;
        let ob = ob.map_or("-".to_string(), |b| b.to_string());
        format!(
            "{MAGIC}\nbase_dev {d}\nbase_ino {i}\nbase_size {s}\nbase_mtime_ns {m}\n\
             overlay_dev {od}\noverlay_ino {oi}\noverlay_btime_ns {ob}\n"
        )
    }

    fn parse(text: &str) -> Result<Recorded, String> {
        let mut lines = text.lines();
        if lines.next() != Some(MAGIC) {
            return Err(format!("its first line is not {MAGIC:?}"));
        }
        let fields: Vec<(&str, &str)> = lines.filter_map(|l| l.split_once(' ')).collect();
        let get = |k: &str| {
            fields
                .iter()
                .find(|f| f.0 == k)
                .map(|f| f.1)
                .ok_or_else(|| format!("no {k}"))
        };
        fn num<T: std::str::FromStr>(k: &str, v: &str) -> Result<T, String> {
            v.parse().map_err(|_| format!("{k} {v:?} is not a number"))
        }
        let n = |k: &str| get(k).and_then(|v| num::<u64>(k, v));
        let t = |k: &str| get(k).and_then(|v| num::<i128>(k, v));
        let born = match get("overlay_btime_ns")? {
            "-" => None,
            v => Some(num::<i128>("overlay_btime_ns", v)?),
        };
        Ok(Recorded {
            base: (
                n("base_dev")?,
                n("base_ino")?,
                n("base_size")?,
                t("base_mtime_ns")?,
            ),
            overlay: (n("overlay_dev")?, n("overlay_ino")?, born),
        })
    }
}

/// A recorded base's [`BaseStamp::content`]: what says it is the same file with the same
/// bytes.
fn without_dev(b: (u64, u64, u64, i128)) -> (u64, u64, i128) {
    (b.1, b.2, b.3)
}

/// What differs between the recorded base `was` and `now`, in words (not the device
/// alone: see `check`).
fn diff(was: (u64, u64, u64, i128), now: (u64, u64, u64, i128)) -> String {
    let t = |ns: i128| {
        format!(
            "{}.{:09}",
            ns.div_euclid(1_000_000_000),
            ns.rem_euclid(1_000_000_000)
        )
    };
    let mut v = Vec::new();
    if was.1 != now.1 {
        v.push(format!(
            "another file (device {} inode {}, recorded device {} inode {})",
            now.0, now.1, was.0, was.1
        ));
    }
    if was.2 != now.2 {
        v.push(format!("size {} → {} bytes", was.2, now.2));
    }
    if was.3 != now.3 {
        v.push(format!("mtime {} → {}", t(was.3), t(now.3)));
    }
    v.join(", ")
}

/// Checks the base `base` (at `base_path`, its stamp when opened) against the stamp file
/// of the overlay open as `file` at `overlay`, writing nothing. `holds_nothing` says
/// whether the overlay has no cluster of its own (asked only when the base differs).
///
/// Errors: [`DiskError::BaseChangedSinceStamp`]; [`DiskError::Stamp`] (unreadable, not a
/// regular file, over [`STAMP_MAX`] bytes or not a stamp: refused, not taken for absent).
pub(super) fn check(
    base: &BaseStamp,
    base_path: &Path,
    file: &File,
    overlay: &Path,
    holds_nothing: impl FnOnce() -> Result<bool, DiskError>,
) -> Result<Verdict, DiskError> {
    let path = stamp_path(overlay);
    let stamp_err = |source| DiskError::Stamp {
        stamp: path.clone(),
        overlay: overlay.to_path_buf(),
        source,
    };
    let Some(text) = read_stamp(&path).map_err(stamp_err)? else {
        return Ok(Verdict::Write);
    };
    let was = Recorded::parse(&text)
        .map_err(|why| stamp_err(std::io::Error::new(std::io::ErrorKind::InvalidData, why)))?;
    let now = Recorded {
        base: base_of(base),
        overlay: overlay_of(file).map_err(stamp_err)?,
    };
    if was == now {
        return Ok(Verdict::Same);
    }
    // Device numbers are not compared: a reboot can renumber the same file system
    // (btrfs subvolumes, NFS, LVM, disks in probe order), and a guest's disk refused for
    // that would be refused for nothing. Inode, size and mtime in ns say the same file.
    let base_same = without_dev(was.base) == without_dev(now.base);
    let overlay_same = (was.overlay.1, was.overlay.2) == (now.overlay.1, now.overlay.2);
    if base_same {
        // Another overlay file over the same base (or the same, renumbered): recorded anew.
        return Ok(Verdict::Write);
    }
    // The birth time tells a file made anew at the path from the one stamped (an inode
    // number is reused at once); without one the two cannot be told apart.
    let same_file = overlay_same && now.overlay.2.is_some();
    if !same_file && holds_nothing()? {
        tracing::info!(
            "overlay {} is a new file holding nothing: its base {} is recorded afresh in {}",
            overlay.display(),
            base_path.display(),
            path.display()
        );
        return Ok(Verdict::Write);
    }
    Err(DiskError::BaseChangedSinceStamp {
        base: base_path.to_path_buf(),
        overlay: overlay.to_path_buf(),
        stamp: path.clone(),
        what: diff(was.base, now.base),
    })
}

/// Records `base` as the base of the overlay open as `file` at `overlay`: a temporary file
/// written and synced, renamed over the stamp file, the folder synced.
///
/// Errors: [`DiskError::Stamp`] (the temporary file's name taken by a link, FIFO or
/// other non-regular file among them).
pub(super) fn write(base: &BaseStamp, file: &File, overlay: &Path) -> Result<(), DiskError> {
    let path = stamp_path(overlay);
    let stamp_err = |source| DiskError::Stamp {
        stamp: path.clone(),
        overlay: overlay.to_path_buf(),
        source,
    };
    let rec = Recorded {
        base: base_of(base),
        overlay: overlay_of(file).map_err(stamp_err)?,
    };
    let mut tmp = path.clone().into_os_string();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    // The overlay's lock keeps a second writer out; a link planted at the temporary name
    // is neither written through nor emptied, a FIFO not waited on.
    let mut f = create_fresh(&tmp).map_err(stamp_err)?;
    f.write_all(rec.text().as_bytes()).map_err(stamp_err)?;
    f.sync_all().map_err(stamp_err)?;
    drop(f);
    std::fs::rename(&tmp, &path).map_err(stamp_err)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(stamp_err)
}
