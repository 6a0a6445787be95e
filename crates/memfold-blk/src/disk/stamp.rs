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
//! Not ctime, which the running guard watches: chmod, chown, `chattr +i`, an xattr or a
//! hard link change it without changing a byte, and an operator protecting a base would
//! have its guests' disks refused for good. mtime moves with every write; only a
//! deliberate `utimensat` back to the recorded value (or a write within one timestamp
//! tick of the recorded one, as for the guard) hides a write in place. An overlay first
//! served before this stamp existed is stamped with its base as found then.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::{BaseStamp, DiskError};

/// First line of a stamp file.
const MAGIC: &str = "memfold-blk base stamp 1";

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
    let mtime = s.mtime.0 as i128 * 1_000_000_000 + s.mtime.1 as i128;
    (s.dev, s.ino, s.size, mtime)
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

/// A base's inode, size and mtime: what says it is the same file with the same bytes.
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
/// Errors: [`DiskError::BaseChangedSinceStamp`]; [`DiskError::Stamp`] (unreadable or not
/// a stamp: refused, not taken for absent).
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
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Verdict::Write),
        Err(e) => return Err(stamp_err(e)),
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
/// Errors: [`DiskError::Stamp`].
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
    // The overlay's lock keeps a second writer out; O_NOFOLLOW: a link planted at the
    // temporary name is not written through.
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(stamp_err)?;
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
