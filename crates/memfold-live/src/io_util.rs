//! Positional reads and writes on raw descriptors (memfds), through std's `FileExt`, and
//! the two calls that free and count a memfd's pages.

use std::fs::File;
use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::fs::{FileExt, MetadataExt};

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

/// Frees `len` bytes of `fd` at `off` (a hole: reads as zeros, takes no memory or disk),
/// keeping the file's size. Returns whether the kernel did; failing only keeps the memory.
pub fn punch_hole(fd: RawFd, off: u64, len: u64) -> bool {
    // SAFETY: fallocate on a descriptor the caller holds; the caller made sure nothing
    // needs the bytes.
    unsafe {
        libc::fallocate(
            fd,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off as libc::off_t,
            len as libc::off_t,
        ) == 0
    }
}

/// Bytes of memory (or disk) `fd` has allocated: its blocks, holes taking none; 0 if
/// fstat fails.
pub fn allocated_bytes(fd: RawFd) -> u64 {
    borrow(fd).metadata().map_or(0, |m| m.blocks() * 512)
}
