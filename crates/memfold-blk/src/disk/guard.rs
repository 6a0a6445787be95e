//! Bad input at the disk (issue 16, "Correct"): a base image that changes under the
//! device ([`BaseGuard`]) and an overlay that is not over the base it is served with
//! ([`Mismatch`]; checked in `open.rs`: [`super::check_overlay`], and by the open of every
//! [`super::OverlayDisk`] on the instance it serves).
//!
//! # A base that changes
//!
//! A base is read-only by contract, but nothing stops a rebuild of the image cache or an
//! operator from writing it, truncating it or putting another file at its path while
//! guests run. Its bytes would then differ from what the overlays were made over and what
//! memfold names by (base, block). At open the device records the file's device, inode,
//! size, mtime and ctime ([`BaseStamp`]); after each base read (and before each overlay
//! write, whose copy-on-write of a partial cluster reads the base) it compares them with
//! the open file's (`fstat`). One check after the read sees any change made before it or
//! during it. A change of size or mtime ([`BaseStamp::content`], what the stamp of
//! `stamp.rs` compares across opens too) is a changed base. A change of ctime alone is
//! not: chmod, chown, `chattr`, an xattr, a hard link or a `utimensat` change it without
//! changing a byte, and a refusal for them would end with a restart that serves the disk
//! again (the stamp ignores ctime). It is checked once per change by a `stat` of the
//! path: a file put in the base's place by a rename moves the open file's ctime (its
//! link count drops), and the path then names another file, which is a changed base
//! (the next open would read that file). On the first difference the
//! base is marked changed for good: every base read, overlay write and discard is
//! refused, with one error line naming the file and what changed. A change racing a
//! write's copy-on-write is caught at the next request. Cost: one `fstat`, ~0.5 µs, per
//! base read of ≥ 60 µs (`O_DIRECT`, 4 KiB; docs/blk-faults.md).
//!
//! Timestamps are the kernel's (coarse ticks where the file system has no fine-grained
//! ones): a write within the same tick as the last change before the open can go
//! unseen, and so can a write whose mtime is then set back (`utimensat`) to the recorded
//! value, as across opens.
//!
//! The guard's verdict lives in memory; a change between two runs of the device is
//! caught by the stamp an overlay keeps of its base (`stamp.rs`).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use memfold_ids::DiskId;

use super::DiskError;

/// What identifies a base file's bytes at one instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BaseStamp {
    /// Device of the file system.
    pub dev: u64,
    /// Inode.
    pub ino: u64,
    /// Size, bytes.
    pub size: u64,
    /// Last modification (seconds, nanoseconds since the epoch).
    pub mtime: (i64, i64),
    /// Last status change (seconds, nanoseconds since the epoch): not part of
    /// [`BaseStamp::content`].
    pub ctime: (i64, i64),
}

impl BaseStamp {
    /// The stamp of `st`.
    pub fn of(st: &rustix::fs::Stat) -> BaseStamp {
        BaseStamp {
            dev: st.st_dev,
            ino: st.st_ino,
            size: st.st_size as u64,
            mtime: (st.st_mtime, st.st_mtime_nsec as i64),
            ctime: (st.st_ctime, st.st_ctime_nsec as i64),
        }
    }

    /// What says the file holds the same bytes: inode, size, mtime (ns since the epoch).
    /// One definition for the running guard and the stamp across opens (`stamp.rs`). Not
    /// the device (a reboot can renumber a file system; an open file keeps its own) nor
    /// ctime (see the module's doc).
    pub fn content(&self) -> (u64, u64, i128) {
        let mtime = self.mtime.0 as i128 * 1_000_000_000 + self.mtime.1 as i128;
        (self.ino, self.size, mtime)
    }

    /// The id memfold names the file's bytes by ([`DiskId::of_file`]): a change the
    /// guard sees is a change of id.
    pub fn disk_id(&self) -> DiskId {
        DiskId::of_file(self.dev, self.ino, self.size, self.content().2)
    }

    /// What differs in `now`, in words (`""` when nothing does).
    pub fn diff(&self, now: &BaseStamp) -> String {
        let t = |(s, n): (i64, i64)| format!("{s}.{n:09}");
        let mut v = Vec::new();
        if (self.dev, self.ino) != (now.dev, now.ino) {
            v.push(format!(
                "another file at its path (device {} inode {} instead of device {} inode {})",
                now.dev, now.ino, self.dev, self.ino
            ));
        }
        if self.size != now.size {
            v.push(format!("size {} → {} bytes", self.size, now.size));
        }
        if self.mtime != now.mtime {
            v.push(format!("mtime {} → {}", t(self.mtime), t(now.mtime)));
        }
        if self.ctime != now.ctime {
            v.push(format!("ctime {} → {}", t(self.ctime), t(now.ctime)));
        }
        v.join(", ")
    }
}

/// Watches one open base file for changes (see the module's doc).
#[derive(Debug)]
pub struct BaseGuard {
    path: PathBuf,
    stamp: BaseStamp,
    /// The ctime last seen with the file still at its path: a new one is checked once.
    ctime_seen: Mutex<(i64, i64)>,
    changed: AtomicBool,
    /// What changed, as first seen.
    what: OnceLock<String>,
}

impl BaseGuard {
    /// A guard of `path`, open as `file`, whose state at open is `stamp`.
    pub fn new(path: &Path, stamp: BaseStamp) -> BaseGuard {
        BaseGuard {
            path: path.to_path_buf(),
            stamp,
            ctime_seen: Mutex::new(stamp.ctime),
            changed: AtomicBool::new(false),
            what: OnceLock::new(),
        }
    }

    /// The base's stamp when it was opened.
    pub fn stamp(&self) -> BaseStamp {
        self.stamp
    }

    /// Whether the base has been seen changed (for good: a base once changed stays so).
    pub fn changed(&self) -> bool {
        self.changed.load(Ordering::Acquire)
    }

    /// Checks the open `file` against the stamp of the open.
    ///
    /// Errors: [`DiskError::BaseChanged`] (logged once, at the first).
    pub fn check(&self, file: &std::fs::File) -> Result<(), DiskError> {
        if !self.changed() {
            let what = match rustix::fs::fstat(file) {
                Ok(st) => self.what_changed(&BaseStamp::of(&st)),
                Err(e) => format!("fstat failed: {e}"),
            };
            if what.is_empty() {
                return Ok(());
            }
            if self.what.set(what).is_ok() {
                self.changed.store(true, Ordering::Release);
                tracing::error!(
                    "base image {} changed under the device ({}): its reads and the overlay's writes are refused from now on (I/O error to the guest); the overlay is left as it is",
                    self.path.display(),
                    self.what.get().map_or("", |s| s.as_str())
                );
            }
        }
        Err(DiskError::BaseChanged {
            path: self.path.clone(),
            what: self.what.get().cloned().unwrap_or_default(),
        })
    }

    /// What changed in the open file, now `now`, in words (`""`: nothing that changes its
    /// bytes). A new ctime alone is accepted, and remembered, if the path still names the
    /// open file.
    fn what_changed(&self, now: &BaseStamp) -> String {
        if self.stamp.content() != now.content() {
            return self.stamp.diff(now);
        }
        let mut seen = self.ctime_seen.lock().unwrap_or_else(|p| p.into_inner());
        if *seen == now.ctime {
            return String::new();
        }
        // Followed as the open followed it: what the next open would read.
        match std::fs::metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == (now.dev, now.ino) => {
                tracing::info!(
                    "base image {}: its status changed (ctime; a chmod, chown, link, xattr or times set), not its bytes: still served",
                    self.path.display()
                );
                *seen = now.ctime;
                String::new()
            }
            Ok(m) => format!(
                "{}; another file at its path (device {} inode {})",
                self.stamp.diff(now),
                m.dev(),
                m.ino()
            ),
            Err(e) => format!("{}; its path: {e}", self.stamp.diff(now)),
        }
    }
}

/// How an overlay fails to match its base.
#[derive(Debug, thiserror::Error)]
pub enum Mismatch {
    /// The overlay has no backing file at all.
    #[error("its header names no backing file")]
    NoBacking,
    /// The overlay's backing file is another file (or none that exists).
    #[error("its header's backing file {named} ({resolved}) is not that file")]
    BackingFile {
        /// The name in the header.
        named: String,
        /// The name resolved against the overlay's folder, and what became of it.
        resolved: String,
    },
    /// The backing format is not `raw` (or is absent, which would mean probing it).
    #[error("its backing format is {0:?}, not \"raw\"")]
    BackingFormat(Option<String>),
    /// The overlay keeps its data in an external file (which is never opened: its name is
    /// the header's, chosen by whoever wrote the overlay).
    #[error("it needs an external data file")]
    DataFile,
    /// The base is not the overlay's size.
    #[error("the base has {base} bytes, the overlay {overlay}")]
    Size {
        /// The base's size, bytes.
        base: u64,
        /// The overlay's virtual size, bytes.
        overlay: u64,
    },
}
