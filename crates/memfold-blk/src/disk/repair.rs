//! An overlay is served only if its last server closed it cleanly or it was checked and
//! repaired since.
//!
//! Why: an allocating write's metadata — the refcount block, then the L2 entry — reaches
//! the overlay's file through imago's flush as plain `pwrite`s, with no sync between them;
//! only the guest's flush syncs. A host crash or power loss between two guest flushes can
//! leave the L2 entry on disk without its refcount: a cluster mapped by offset A with
//! refcount 0. imago has no consistency check, so after the restart the next allocating
//! write (offset D) takes that cluster as free: A then reads D's bytes, and writes to A
//! overwrite D — silent corruption of data written, and flushed, after the crash. (A kill
//! of the device alone is safe: every `pwrite` it completed is in the file.) QEMU's answer for
//! qcow2 with lazy refcounts is the same idea as this one: a dirty flag, and a repair at
//! the next open.
//!
//! So an open for serving makes a marker next to the overlay, `<overlay>.memfold-dirty`
//! ([`dirty_path`]; created, synced and its folder synced) before anything can write the
//! overlay ([`mark`], from `open::served`), and a clean close
//! ([`super::OverlayDisk::close_clean`]) removes it only after a successful sync of the
//! overlay, under the sync latch (a sync that failed once keeps it for good). An open that
//! finds the marker (the last device was killed, or the host crashed) first checks the
//! overlay against its base with nothing written ([`super::check_overlay`]), then runs
//! `qemu-img check -r all -f qcow2` on that very file ([`repair_if_dirty`]) before it is
//! locked (qemu-img takes QEMU's image locks, which the device's lock conflicts with),
//! and refuses to serve it ([`DiskError::Unrepaired`]) unless the check ends with no
//! errors (exit status 0) or with leaked clusters alone (3: space lost, nothing wrong
//! with the data). The marker is kept until the new open succeeds; that open makes it
//! anew anyway.
//!
//! A marker that cannot be made refuses the open ([`DiskError::Marker`]), unlike a stamp
//! that cannot be written (served with a warning): an overlay served without one would
//! not be repaired after a crash, which is the corruption above.

use std::ffi::OsStr;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use super::DiskError;

/// The dirty marker of the overlay at `overlay`: `<overlay>.memfold-dirty`. It exists
/// while a device serves the overlay and after one that did not close it cleanly (killed,
/// or the host crashed); the next open then repairs the overlay. Removing it by hand makes
/// the next open serve the overlay unchecked (docs/blk-faults.md: only after a
/// `qemu-img check` of it reported no errors).
pub fn dirty_path(overlay: &Path) -> PathBuf {
    let mut s = overlay.as_os_str().to_os_string();
    s.push(".memfold-dirty");
    PathBuf::from(s)
}

/// The exit statuses of `qemu-img check -r all` after which the overlay is served: 0, no
/// errors (after the repair); 3, leaked clusters remain (space never freed, no data at
/// risk). 1 (check not completed), 2 (corruptions remain), 63 (no check for the format)
/// and a death by signal refuse.
const REPAIRED: [i32; 2] = [0, 3];

/// Makes the dirty marker of the overlay at `overlay` (a few words for a reader: who made
/// it and what it means), synced, and its folder synced: it must be on disk before any
/// write to the overlay can be. Made anew if it exists.
///
/// Errors: [`DiskError::Marker`] (EIO, a full disk, a link, FIFO or other non-regular file
/// at its name). A folder the device may not write is
/// no error: the overlay is served without a marker, logged.
pub(super) fn mark(overlay: &Path) -> Result<(), DiskError> {
    let path = dirty_path(overlay);
    let err = marker_err(&path, overlay);
    // The overlay's lock keeps a second writer out; a link planted at the marker's name
    // is neither written through nor emptied, a FIFO not waited on. Made anew: the
    // repair (if one was due) is done, and nothing is written before the marker is back.
    let opened = super::stamp::create_fresh(&path);
    let mut f = match opened {
        // A folder the device may not write (a pre-provisioned image, a confining profile
        // that allows the image alone): served as before markers existed, as the stamp
        // is, said once; a crash is then not repaired at the next open. Anything else
        // (EIO, a full disk) refuses.
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem
            ) =>
        {
            tracing::warn!(
                "cannot make overlay {}'s dirty marker {} ({e}): served without it, so a \
                 host crash between two guest flushes is not repaired at the next open",
                overlay.display(),
                path.display()
            );
            return Ok(());
        }
        r => r.map_err(err)?,
    };
    let text = format!(
        "memfold-blk dirty marker 1\npid {}\n\
         overlay {} is being served, or its last device did not close it cleanly: \
         the next open repairs it with qemu-img check -r all\n",
        std::process::id(),
        overlay.display()
    );
    f.write_all(text.as_bytes()).map_err(err)?;
    f.sync_all().map_err(err)?;
    drop(f);
    sync_folder(&path).map_err(err)
}

/// Removes the dirty marker of the overlay at `overlay` and syncs its folder (without the
/// sync a crash could bring the marker back: a needless repair, nothing worse). Called only
/// once the overlay is synced. An absent marker (removed by hand) is no error.
///
/// Errors: [`DiskError::Marker`].
pub(super) fn unmark(overlay: &Path) -> Result<(), DiskError> {
    let path = dirty_path(overlay);
    let err = marker_err(&path, overlay);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        r => r.map_err(err)?,
    }
    sync_folder(&path).map_err(err)
}

/// If the overlay at `overlay` has a dirty marker, opens it once and checks that file
/// against the raw base `base` with nothing written (`open::checked_overlay`, as
/// [`super::check_overlay`]: a mismatched overlay, one with an external data file or a
/// changed base is refused as such, not "repaired"), waits for no other open to lock it
/// (`open::wait_unlocked`: a device still serving it is [`DiskError::InUse`], not a failed
/// repair), and repairs that very file with `qemu_img check -r all -f qcow2` (`qemu_img`:
/// the program and its first arguments, `qemu-img` found on `PATH`; tests give another).
/// Logs one line with qemu-img's summary. The marker is left as it is.
///
/// qemu-img is given the file as `/proc/<this pid>/fd/<its descriptor>`, backing `null`,
/// not the overlay's path: a file put at the path after the check (a rename, a symlink)
/// could name an external data file, which qemu-img would open read-write and "repair"
/// (another guest's disk; `one_open.rs`'s swap test catches it), and the base, which it
/// does not need, is not opened either. What the check cannot cover is the checked file's
/// header rewritten in place before qemu-img reads it (as for imago, whose second parse
/// sees that: whoever can write the overlay can write its data anyway).
///
/// Errors: [`DiskError::Unrepaired`] (qemu-img missing, failing, or leaving errors);
/// [`DiskError::InUse`]; [`check_overlay`](super::check_overlay)'s errors;
/// [`DiskError::Marker`] (the marker unreadable).
pub(super) fn repair_if_dirty(
    base: &Path,
    overlay: &Path,
    qemu_img: &[&OsStr],
) -> Result<(), DiskError> {
    let marker = dirty_path(overlay);
    match std::fs::symlink_metadata(&marker) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(marker_err(&marker, overlay)(e)),
        Ok(_) => {}
    }
    let file = super::open::checked_overlay(base, overlay)?;
    super::open::wait_unlocked(&file, overlay)?;
    // Held open until qemu-img has exited: its /proc link is this process's descriptor.
    let image = format!(
        r#"json:{{"backing":null,"file":{{"driver":"file","filename":"/proc/{}/fd/{}"}}}}"#,
        std::process::id(),
        file.as_raw_fd()
    );
    let program = qemu_img.iter().map(|w| w.to_string_lossy());
    let command = format!(
        "{} check -r all -f qcow2 '{image}'",
        program.collect::<Vec<_>>().join(" "),
    );
    let unrepaired = |status: String, output: String| DiskError::Unrepaired {
        overlay: overlay.to_path_buf(),
        marker: marker.clone(),
        command: command.clone(),
        status,
        output,
    };
    let out = std::process::Command::new(qemu_img[0])
        .args(&qemu_img[1..])
        .args(["check", "-r", "all", "-f", "qcow2", &image])
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| unrepaired("could not run".into(), e.to_string()))?;
    drop(file);
    let output = one_line(&out);
    match out.status.code() {
        Some(c) if REPAIRED.contains(&c) => {}
        Some(c) => return Err(unrepaired(format!("exit status {c}"), output)),
        None => return Err(unrepaired(format!("{}", out.status), output)),
    }
    if output.contains("repaired") || out.status.code() == Some(3) {
        // The summary, not one line per cluster repaired.
        let summary = output
            .find("The following inconsistencies")
            .map_or(output.as_str(), |i| &output[i..]);
        tracing::warn!(
            "overlay {} was not closed cleanly ({} exists): `{command}` repaired it: {summary}",
            overlay.display(),
            marker.display()
        );
    } else {
        tracing::info!(
            "overlay {} was not closed cleanly ({} exists): `{command}` found no errors",
            overlay.display(),
            marker.display()
        );
    }
    Ok(())
}

/// Most bytes of qemu-img's output kept (its last ones: the summary, the error).
const OUTPUT_MAX: usize = 4000;

/// qemu-img's error output then standard output as one line: its non-empty lines joined
/// with `; `, only the last [`OUTPUT_MAX`] bytes kept. In that order because the error
/// output has one line per cluster repaired (can be many), the standard output ends with
/// the summary.
fn one_line(out: &std::process::Output) -> String {
    let text = [&out.stderr, &out.stdout]
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .join("\n");
    let line = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    match line.len() > OUTPUT_MAX {
        false => line,
        true => {
            let mut cut = line.len() - OUTPUT_MAX;
            while !line.is_char_boundary(cut) {
                cut += 1;
            }
            format!("…{}", &line[cut..])
        }
    }
}

/// Syncs the folder of `path` (a name made or removed in it).
fn sync_folder(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir).and_then(|d| d.sync_all())
}

/// [`DiskError::Marker`] of the marker `marker` of `overlay`, from an error.
fn marker_err<'a>(
    marker: &'a Path,
    overlay: &'a Path,
) -> impl Fn(std::io::Error) -> DiskError + Copy + 'a {
    move |source| DiskError::Marker {
        marker: marker.to_path_buf(),
        overlay: overlay.to_path_buf(),
        source,
    }
}

impl super::OverlayDisk {
    /// Closes the overlay cleanly, once the device is done with it (its QEMU has exited):
    /// imago's cached metadata written, the file synced (under the sync latch: once a sync
    /// failed, none succeeds), and only then the dirty marker removed, so the next open
    /// serves it without a repair. Later writes and discards are refused (the marker that
    /// would say they may be half on disk is gone).
    ///
    /// Errors: [`DiskError::Io`] (the flush or sync failed, now or before: the marker is
    /// kept and the next open repairs); [`DiskError::Marker`] (not removed: a needless
    /// repair at the next open).
    pub fn close_clean(&mut self) -> Result<(), DiskError> {
        super::Disk::flush(self)?;
        // From here the marker may be gone.
        self.closed = true;
        unmark(&self.path)
    }

    /// Refuses a write or discard (`op` of `len` bytes at `off`) once closed cleanly.
    ///
    /// Errors: [`DiskError::Io`].
    pub(super) fn check_open(&self, op: &'static str, off: u64, len: u64) -> Result<(), DiskError> {
        match self.closed {
            false => Ok(()),
            true => Err(DiskError::Io {
                path: self.path.clone(),
                op,
                off,
                len,
                source: std::io::Error::other(
                    "the overlay was closed cleanly (its dirty marker removed): no more writes",
                ),
            }),
        }
    }
}
