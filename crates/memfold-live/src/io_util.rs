//! Positional reads and writes on raw descriptors (memfds), through std's `FileExt`.

use std::fs::File;
use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::fs::FileExt;

/// A `File` view of `fd` that does not close it.
fn borrow(fd: RawFd) -> ManuallyDrop<File> {
    // SAFETY: the caller's fd stays open for the call; ManuallyDrop never closes it.
    ManuallyDrop::new(unsafe { File::from_raw_fd(fd) })
}

/// Reads `buf.len()` bytes at `off`; bytes beyond the end of the file read as zeros.
///
/// Errors: the read failed.
pub fn pread_exact(fd: RawFd, buf: &mut [u8], off: u64) -> io::Result<()> {
    let f = borrow(fd);
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                break;
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf` at `off`.
///
/// Errors: the write failed (ENOSPC, ENOMEM).
pub fn pwrite_all(fd: RawFd, buf: &[u8], off: u64) -> io::Result<()> {
    borrow(fd).write_all_at(buf, off)
}
