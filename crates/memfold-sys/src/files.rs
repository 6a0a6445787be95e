//! Files memfold finds at a path it was given or keeps (a block device's base images and
//! stamps, memfoldd's candidates): what a file that is not a regular one is, in words,
//! and reading one while nobody writes it.

use std::os::unix::fs::FileTypeExt;

/// What kind of file `t` is, for an error that refuses it: "a FIFO", "a symbolic link"
/// (as `symlink_metadata` sees one), "a folder", ... ("a regular file" for one).
pub fn kind_of(t: &std::fs::FileType) -> &'static str {
    if t.is_file() {
        "a regular file"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_dir() {
        "a folder"
    } else if t.is_block_device() {
        "a block device node"
    } else if t.is_char_device() {
        "a character device node"
    } else {
        "another kind of file"
    }
}

/// The file of `file` opened again, read-only (`O_DIRECT` where its file system takes
/// it, close-on-exec), through `/proc/self/fd` — the same inode, whatever its path is now
/// — as an open file description of this process's own: what is set on it with `fcntl`
/// (a lease, its signal, its owner) is shared with no process that passed `file` (a
/// peer sharing the description could change the signal a lease break sends, to
/// `SIGKILL`).
///
/// Errors: the open failed, or opened another file than `file`'s (its device and inode
/// compared).
pub fn reopen_read_only(file: &std::fs::File) -> std::io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let path = format!("/proc/self/fd/{}", file.as_raw_fd());
    let open = |flags| {
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(flags | libc::O_CLOEXEC)
            .open(&path)
    };
    let again = match open(libc::O_DIRECT) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => open(0)?,
        r => r?,
    };
    let (a, b) = (file.metadata()?, again.metadata()?);
    if (a.dev(), a.ino()) != (b.dev(), b.ino()) {
        return Err(std::io::Error::other(format!(
            "{path} opened another file than its descriptor's"
        )));
    }
    Ok(again)
}

/// Why [`without_writers`] did not run its closure.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// A process has the file open for writing now.
    #[error("the file is open for writing")]
    Writer,
    /// No read lease can be taken on it here: not the file's owner and without
    /// `CAP_LEASE`, a file system without leases, or `fs.leases-enable` 0.
    #[error("no read lease: {0}")]
    Unavailable(std::io::Error),
}

/// Runs `f` while no process has `file` open for writing: under a read lease
/// (`F_SETLEASE F_RDLCK`), which the kernel grants only while the file is open for
/// writing nowhere, and which holds a writer's `open` (and a truncate) until it is let go
/// right after `f` (also if `f` panics). So what `f` reads of the file is what one moment
/// of it held, and no write was under way meanwhile. `file` must be open read-only, in
/// an open file description no other process shares ([`reopen_read_only`]): the kernel
/// tells the holder of a lease a writer waits for with the description's signal, `SIGIO`
/// by default (its default action ends the process), set here to `SIGURG` (ignored
/// unless handled) — a process sharing the description could set it back, or to
/// `SIGKILL`.
///
/// Errors: [`LeaseError::Writer`] if the file is open for writing now (`f` not run);
/// [`LeaseError::Unavailable`] if no lease can be taken here (`f` not run).
pub fn without_writers<T>(file: &std::fs::File, f: impl FnOnce() -> T) -> Result<T, LeaseError> {
    use std::os::fd::AsRawFd;
    // `F_SETSIG` (Linux's fcntl.h; the libc crate does not name it).
    const F_SETSIG: libc::c_int = 10;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor `file` owns; F_SETSIG takes a signal number.
    if unsafe { libc::fcntl(fd, F_SETSIG, libc::SIGURG) } < 0 {
        return Err(LeaseError::Unavailable(std::io::Error::last_os_error()));
    }
    // SAFETY: as above; F_SETLEASE takes a lease type.
    if unsafe { libc::fcntl(fd, libc::F_SETLEASE, libc::F_RDLCK) } < 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::EAGAIN) => LeaseError::Writer,
            _ => LeaseError::Unavailable(e),
        });
    }
    /// Lets the lease go when dropped.
    struct Held(std::os::fd::RawFd);
    impl Drop for Held {
        fn drop(&mut self) {
            // SAFETY: fcntl on the descriptor the lease was taken on, still open (the
            // caller's `file` outlives this). A failed unlock leaves the lease, which the
            // kernel breaks for a writer after `lease-break-time` at most: nothing lost.
            unsafe { libc::fcntl(self.0, libc::F_SETLEASE, libc::F_UNLCK) };
        }
    }
    let _held = Held(fd);
    Ok(f())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The file opened again is the same file, in a description of its own: a signal set
    /// on the first is not the second's. Fails if the description were shared.
    #[test]
    fn a_file_reopened_read_only_is_its_own_description() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("base");
        std::fs::write(&path, [7u8; 4096]).unwrap();
        let theirs = std::fs::File::open(&path).unwrap();
        let ours = reopen_read_only(&theirs).unwrap();
        // SAFETY: fcntl on descriptors the test owns (F_SETSIG 10, F_GETSIG 11).
        unsafe { libc::fcntl(theirs.as_raw_fd(), 10, libc::SIGKILL) };
        // SAFETY: as above.
        let sig = unsafe { libc::fcntl(ours.as_raw_fd(), 11) };
        assert_eq!(sig, 0, "the reopened file shares the peer's description");
        assert_eq!(without_writers(&ours, || 4).unwrap(), 4);
    }

    /// The closure runs while no process has the file open for writing, and not while
    /// one has; the lease is let go after (a writer opens it at once). Needs to own the
    /// file (the test makes it).
    #[test]
    fn a_read_lease_runs_only_without_writers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("base");
        std::fs::write(&path, [7u8; 4096]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        assert_eq!(without_writers(&file, || 1).unwrap(), 1);
        let writer = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let r = without_writers(&file, || 2);
        assert!(matches!(r, Err(LeaseError::Writer)), "{r:?}");
        drop(writer);
        assert_eq!(without_writers(&file, || 3).unwrap(), 3);
        // Let go: a writer opens without waiting for the lease-break time.
        let t = std::time::Instant::now();
        drop(std::fs::OpenOptions::new().write(true).open(&path).unwrap());
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn each_kind_is_named() {
        let d = tempfile::tempdir().unwrap();
        let link = d.path().join("l");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let kind =
            |p: &std::path::Path| kind_of(&std::fs::symlink_metadata(p).unwrap().file_type());
        assert_eq!(kind(&link), "a symbolic link");
        assert_eq!(kind(d.path()), "a folder");
        assert_eq!(
            kind(std::path::Path::new("/dev/null")),
            "a character device node"
        );
        let f = d.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        assert_eq!(kind(&f), "a regular file");
    }
}
