//! Positional reads and writes on raw descriptors (memfds).

use std::io;
use std::os::fd::RawFd;

/// Reads `buf.len()` bytes at `off`; bytes beyond the end of the file read as zeros.
///
/// Errors: the read failed.
pub fn pread_exact(fd: RawFd, buf: &mut [u8], off: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: writes into buf[done..].
        let n = unsafe {
            libc::pread(
                fd,
                buf[done..].as_mut_ptr() as *mut libc::c_void,
                buf.len() - done,
                (off + done as u64) as i64,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            buf[done..].fill(0); // beyond the end of the file reads as zeros
            return Ok(());
        }
        done += n as usize;
    }
    Ok(())
}

/// Writes all of `buf` at `off`.
///
/// Errors: the write failed (ENOSPC, ENOMEM).
pub fn pwrite_all(fd: RawFd, buf: &[u8], off: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: reads from buf[done..].
        let n = unsafe {
            libc::pwrite(
                fd,
                buf[done..].as_ptr() as *const libc::c_void,
                buf.len() - done,
                (off + done as u64) as i64,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += n as usize;
    }
    Ok(())
}
