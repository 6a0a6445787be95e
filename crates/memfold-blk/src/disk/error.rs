//! The errors of disk images ([`DiskError`]): each names the image, the operation and
//! the byte range, so that an operator can tell which guest's disk failed and where.

use std::path::PathBuf;

use super::Mismatch;

/// Errors of disk images.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// An image could not be opened.
    #[error("disk image {path}: {source}")]
    Open {
        /// The image.
        path: PathBuf,
        /// The OS or format error.
        source: std::io::Error,
    },
    /// An I/O request failed.
    #[error("disk image {path}: {op} of {len} bytes at byte {off}: {source}")]
    Io {
        /// The image.
        path: PathBuf,
        /// `read`, `write`, `flush`, `discard`, `write zeroes`.
        op: &'static str,
        /// Disk byte offset.
        off: u64,
        /// Length, bytes.
        len: u64,
        /// The OS or format error.
        source: std::io::Error,
    },
    /// A request reaches past the end of the disk.
    #[error("disk image {path}: {op} of {len} bytes at byte {off} is past its end ({size} bytes)")]
    OutOfRange {
        /// The image.
        path: PathBuf,
        /// The request.
        op: &'static str,
        /// Disk byte offset.
        off: u64,
        /// Length, bytes.
        len: u64,
        /// The disk's size, bytes.
        size: u64,
    },
    /// A write to a read-only disk.
    #[error("disk image {path} is read-only")]
    ReadOnly {
        /// The image.
        path: PathBuf,
    },
    /// The base image changed since the device opened it
    /// ([`BaseGuard`](super::BaseGuard)): its bytes are no longer those the overlay and
    /// memfold's names of its blocks are about.
    #[error("base image {path} changed under the device ({what}): refused")]
    BaseChanged {
        /// The base image.
        path: PathBuf,
        /// What changed (size, mtime, ctime, the file at the path).
        what: String,
    },
    /// The base differs from the one the overlay was first served over (its stamp file,
    /// [`stamp_path`](super::stamp_path)): the overlay's clusters were copied from the
    /// old base's bytes, so serving it over this one would mix the two.
    #[error("base image {base} changed since overlay {overlay} was first served over it ({what}; recorded in {stamp}): refused, nothing is served and neither file is written (docs/blk-faults.md says what to do)")]
    BaseChangedSinceStamp {
        /// The base image.
        base: PathBuf,
        /// The overlay.
        overlay: PathBuf,
        /// The stamp file.
        stamp: PathBuf,
        /// What differs (device and inode, size, mtime).
        what: String,
    },
    /// The overlay's stamp file cannot be read, understood or written.
    #[error("base stamp {stamp} of overlay {overlay}: {source}")]
    Stamp {
        /// The stamp file.
        stamp: PathBuf,
        /// The overlay.
        overlay: PathBuf,
        /// The OS error, or what is wrong with its contents.
        source: std::io::Error,
    },
    /// Another open holds the overlay's lock (another memfold-blk, a QEMU, a qemu-img).
    #[error("overlay {path} is in use by another process (another memfold-blk, a QEMU or a qemu-img holds a lock on it): refused, nothing is served")]
    InUse {
        /// The overlay.
        path: PathBuf,
    },
    /// The overlay's dirty marker ([`dirty_path`](super::dirty_path)) cannot be made,
    /// read or removed.
    #[error("dirty marker {marker} of overlay {overlay}: {source}; the overlay is not served without it (it says whether the overlay needs a repair after a crash)")]
    Marker {
        /// The marker file.
        marker: PathBuf,
        /// The overlay.
        overlay: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The overlay was not closed cleanly by its last device (its dirty marker exists:
    /// killed, or the host crashed) and `qemu-img check -r all` did not repair it.
    #[error("overlay {overlay} was not closed cleanly by its last device ({marker} exists: killed, or the host crashed), so it may map a cluster it does not count, and its repair failed: `{command}` (the overlay by its descriptor): {status}: {output}; refused, nothing is served. Run `qemu-img check -r all -f qcow2 {overlay}` by hand with no device serving the overlay: once it reports no errors (or only leaked clusters) the next open serves it; if errors remain, restore the overlay from a backup (removing {marker} serves it unchecked: data can be silently overwritten)")]
    Unrepaired {
        /// The overlay.
        overlay: PathBuf,
        /// Its dirty marker.
        marker: PathBuf,
        /// The command run, as a shell line (qemu-img given the overlay's descriptor).
        command: String,
        /// How it ended (`exit status 2`, `could not run`).
        status: String,
        /// What it said (error output then standard output, as one line).
        output: String,
    },
    /// A qcow2 overlay is not over the base it is served with
    /// ([`check_overlay`](super::check_overlay)).
    #[error("overlay {overlay} does not match the base {base}: {why}; nothing is served and neither file is written")]
    OverlayMismatch {
        /// The overlay.
        overlay: PathBuf,
        /// The base it was given with.
        base: PathBuf,
        /// How it does not match.
        why: Mismatch,
    },
}
