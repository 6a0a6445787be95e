//! A minimal userfaultfd: the ioctls memfold needs on shmem (memfd) guest RAM.
//!
//! Raw ioctls (see the kernel's `Documentation/admin-guide/mm/userfaultfd.rst`) rather than
//! the `userfaultfd` crate, whose bindgen build needs libclang on every machine; the ABI
//! below is the stable `linux/userfaultfd.h` one.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

const UFFDIO_API: libc::c_ulong = 0xC018_AA3F;
const UFFDIO_REGISTER: libc::c_ulong = 0xC020_AA00;
const UFFDIO_WAKE: libc::c_ulong = 0x8010_AA02;
const UFFDIO_WRITEPROTECT: libc::c_ulong = 0xC018_AA06;
const UFFDIO_COPY: libc::c_ulong = 0xC028_AA03;
const UFFDIO_ZEROPAGE: libc::c_ulong = 0xC020_AA04;
const UFFDIO_CONTINUE: libc::c_ulong = 0xC020_AA07;
/// `UFFDIO_COPY_MODE_WP` / `UFFDIO_CONTINUE_MODE_WP`: install the page write-protected.
const FILL_MODE_WP: u64 = 1 << 1;

/// `UFFD_FEATURE_EVENT_REMAP`: a registered VMA moved by mremap keeps its registration
/// (and its write-protected PTEs); the mover waits until the event is read.
pub const FEATURE_EVENT_REMAP: u64 = 1 << 2;
/// `UFFD_FEATURE_MISSING_SHMEM`.
pub const FEATURE_MISSING_SHMEM: u64 = 1 << 5;
/// `UFFD_FEATURE_MINOR_SHMEM`: minor faults (page in the page cache, no PTE) on shmem.
pub const FEATURE_MINOR_SHMEM: u64 = 1 << 10;
/// `UFFD_FEATURE_THREAD_ID`: fault messages carry the faulting thread.
pub const FEATURE_THREAD_ID: u64 = 1 << 8;
/// `UFFD_FEATURE_WP_HUGETLBFS_SHMEM`: write-protect on shmem, kept across zaps.
pub const FEATURE_WP_SHMEM: u64 = 1 << 12;

/// Register mode: faults on missing pages.
pub const MODE_MISSING: u64 = 1;
/// Register mode: faults on writes to write-protected pages.
pub const MODE_WP: u64 = 2;
/// Register mode: minor faults (the page exists, its PTE does not).
pub const MODE_MINOR: u64 = 4;

/// A page-fault message: `UFFD_EVENT_PAGEFAULT`.
const EVENT_PAGEFAULT: u8 = 0x12;
/// `UFFD_EVENT_REMAP`.
const EVENT_REMAP: u8 = 0x14;
/// Fault flag: a write.
const PAGEFAULT_FLAG_WRITE: u64 = 1;
/// Fault flag: a write to a write-protected page.
const PAGEFAULT_FLAG_WP: u64 = 2;
/// Fault flag: a minor fault.
const PAGEFAULT_FLAG_MINOR: u64 = 4;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
struct UffdioContinue {
    range: UffdioRange,
    mode: u64,
    mapped: i64,
}

#[repr(C)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}

#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

/// `struct uffd_msg`: 32 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawMsg {
    event: u8,
    _reserved: [u8; 7],
    arg: [u64; 3],
}

/// One event read from the userfaultfd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// A thread faulted at `addr` (page-aligned by the caller) and waits.
    Fault {
        /// Faulting address (exact, not aligned).
        addr: u64,
        /// A write (else a read of a missing page).
        write: bool,
        /// The page was write-protected.
        wp: bool,
        /// A minor fault: the page is in the memfd, only its PTE is missing.
        minor: bool,
    },
    /// A registered range moved (mremap); reading this lets the mover continue.
    Remap,
    /// Another event (fork, remove, unmap): nothing to do for memfold.
    Other(u8),
}

/// A userfaultfd in this process.
pub struct Uffd {
    fd: OwnedFd,
}

impl Uffd {
    /// Opens a userfaultfd (non-blocking, close-on-exec) for all faults, kernel ones
    /// included (not `UFFD_USER_MODE_ONLY`: the kernel's writes into guest RAM for QEMU's
    /// disk threads must reach us too), and enables `features`.
    ///
    /// Errors: the syscall is refused (needs CAP_SYS_PTRACE or vm.unprivileged_userfaultfd),
    /// or a requested feature is not available (the error names the missing bits).
    pub fn open(features: u64) -> io::Result<Uffd> {
        // SAFETY: plain syscall returning a new fd or -1.
        let fd =
            unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let mut api = UffdioApi {
            api: 0xAA,
            features,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API reads and writes a UffdioApi.
        if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) } != 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("UFFDIO_API with features {features:#x}: {e}"),
            ));
        }
        // The kernel answers with every feature it has; ours must be among them.
        if api.features & features != features {
            return Err(io::Error::other(format!(
                "userfaultfd features {:#x} missing (kernel has {:#x})",
                features & !api.features,
                api.features
            )));
        }
        Ok(Uffd { fd })
    }

    /// Registers `[start, start+len)` with `mode` ([`MODE_MISSING`], [`MODE_WP`]).
    ///
    /// Errors: the range is not page-aligned or not a mapping the mode supports.
    pub fn register(&self, start: u64, len: u64, mode: u64) -> io::Result<()> {
        let mut r = UffdioRegister {
            range: UffdioRange { start, len },
            mode,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes a UffdioRegister.
        self.check(
            unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_REGISTER, &mut r) },
            "UFFDIO_REGISTER",
            start,
        )
    }

    /// Write-protects (`protect`) or unprotects a registered range; unprotecting wakes
    /// threads waiting on it.
    ///
    /// Errors: the range is not registered with [`MODE_WP`].
    pub fn write_protect(&self, start: u64, len: u64, protect: bool) -> io::Result<()> {
        let mut w = UffdioWriteprotect {
            range: UffdioRange { start, len },
            mode: protect as u64,
        };
        // SAFETY: UFFDIO_WRITEPROTECT reads and writes a UffdioWriteprotect.
        self.check(
            unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut w) },
            "UFFDIO_WRITEPROTECT",
            start,
        )
    }

    /// Wakes threads waiting on faults in `[start, start+len)` so they retry.
    ///
    /// Errors: invalid range.
    pub fn wake(&self, start: u64, len: u64) -> io::Result<()> {
        let mut r = UffdioRange { start, len };
        // SAFETY: UFFDIO_WAKE reads a UffdioRange.
        self.check(
            unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_WAKE, &mut r) },
            "UFFDIO_WAKE",
            start,
        )
    }

    /// Fills the missing page(s) at `[dst, dst+src.len())` with `src`, write-protected if
    /// `wp`, and wakes the waiting threads (`UFFDIO_COPY`). A page filled meanwhile
    /// (`EEXIST`) only wakes.
    ///
    /// Errors: `dst` is not a registered missing range; the host is out of memory.
    pub fn copy(&self, dst: u64, src: &[u8], wp: bool) -> io::Result<()> {
        let mut c = UffdioCopy {
            dst,
            src: src.as_ptr() as u64,
            len: src.len() as u64,
            mode: if wp { FILL_MODE_WP } else { 0 },
            copy: 0,
        };
        // SAFETY: UFFDIO_COPY reads `src` (valid for len bytes) and writes `c.copy`.
        let rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_COPY, &mut c) };
        self.filled(rc, "UFFDIO_COPY", dst, src.len() as u64)
    }

    /// Fills the missing page(s) at `[dst, dst+len)` with zeros and wakes the waiting
    /// threads (`UFFDIO_ZEROPAGE`; on shmem this allocates a zeroed page). A page filled
    /// meanwhile (`EEXIST`) only wakes.
    ///
    /// Errors: `dst` is not a registered missing range; the host is out of memory.
    pub fn zeropage(&self, dst: u64, len: u64) -> io::Result<()> {
        let mut z = UffdioZeropage {
            range: UffdioRange { start: dst, len },
            mode: 0,
            zeropage: 0,
        };
        // SAFETY: UFFDIO_ZEROPAGE reads the range and writes `z.zeropage`.
        let rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_ZEROPAGE, &mut z) };
        self.filled(rc, "UFFDIO_ZEROPAGE", dst, len)
    }

    /// Maps the memfd's existing page(s) at `[dst, dst+len)` after a minor fault,
    /// write-protected if `wp`, and wakes the waiting threads (`UFFDIO_CONTINUE`). Already
    /// mapped (`EEXIST`) only wakes.
    ///
    /// Errors: `dst` is not a registered minor range.
    pub fn cont(&self, dst: u64, len: u64, wp: bool) -> io::Result<()> {
        let mut c = UffdioContinue {
            range: UffdioRange { start: dst, len },
            mode: if wp { FILL_MODE_WP } else { 0 },
            mapped: 0,
        };
        // SAFETY: UFFDIO_CONTINUE reads the range and writes `c.mapped`.
        let rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_CONTINUE, &mut c) };
        self.filled(rc, "UFFDIO_CONTINUE", dst, len)
    }

    fn filled(&self, rc: libc::c_int, what: &str, dst: u64, len: u64) -> io::Result<()> {
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EEXIST) {
            return self.wake(dst, len);
        }
        Err(io::Error::new(e.kind(), format!("{what} at {dst:#x}: {e}")))
    }

    /// Reads one event if one is pending (the fd is non-blocking).
    ///
    /// Errors: read failures other than "nothing pending".
    pub fn read_event(&self) -> io::Result<Option<Event>> {
        let mut m = RawMsg {
            event: 0,
            _reserved: [0; 7],
            arg: [0; 3],
        };
        // SAFETY: reads at most 32 bytes into a 32-byte repr(C) struct.
        let n = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                &mut m as *mut RawMsg as *mut libc::c_void,
                std::mem::size_of::<RawMsg>(),
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::WouldBlock {
                Ok(None)
            } else {
                Err(e)
            };
        }
        if n as usize != std::mem::size_of::<RawMsg>() {
            return Err(io::Error::other(format!(
                "short userfaultfd message: {n} bytes"
            )));
        }
        Ok(Some(match m.event {
            EVENT_PAGEFAULT => Event::Fault {
                addr: m.arg[1],
                write: m.arg[0] & PAGEFAULT_FLAG_WRITE != 0,
                wp: m.arg[0] & PAGEFAULT_FLAG_WP != 0,
                minor: m.arg[0] & PAGEFAULT_FLAG_MINOR != 0,
            },
            EVENT_REMAP => Event::Remap,
            other => Event::Other(other),
        }))
    }

    fn check(&self, rc: libc::c_int, what: &str, addr: u64) -> io::Result<()> {
        if rc == 0 {
            Ok(())
        } else {
            let e = io::Error::last_os_error();
            Err(io::Error::new(
                e.kind(),
                format!("{what} at {addr:#x}: {e}"),
            ))
        }
    }
}

impl AsRawFd for Uffd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
