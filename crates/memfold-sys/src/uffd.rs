//! A minimal userfaultfd: the ioctls memfold needs on shmem (memfd) guest RAM.
//!
//! Not the `userfaultfd` crate (0.9): its `userfaultfd-sys` runs bindgen, so libclang, at
//! every build, it has no `UFFDIO_COPY_MODE_WP` / `UFFDIO_CONTINUE_MODE_WP` (installing a
//! page write-protected) and its feature flags lack `MINOR_SHMEM` and
//! `WP_HUGETLBFS_SHMEM`. Raw ioctls instead (see the kernel's
//! `Documentation/admin-guide/mm/userfaultfd.rst`); the ABI below is the stable
//! `linux/userfaultfd.h` one.

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;

use rustix::mm::UserfaultfdFlags;

mod held;
pub use held::HeldPage;

const UFFDIO_API: libc::c_ulong = 0xC018_AA3F;
const UFFDIO_REGISTER: libc::c_ulong = 0xC020_AA00;
const UFFDIO_WAKE: libc::c_ulong = 0x8010_AA02;
const UFFDIO_WRITEPROTECT: libc::c_ulong = 0xC018_AA06;
const UFFDIO_COPY: libc::c_ulong = 0xC028_AA03;
const UFFDIO_ZEROPAGE: libc::c_ulong = 0xC020_AA04;
const UFFDIO_CONTINUE: libc::c_ulong = 0xC020_AA07;
/// `USERFAULTFD_IOC_NEW` (`_IO(0xAA, 0x00)`), on `/dev/userfaultfd`.
const USERFAULTFD_IOC_NEW: libc::c_ulong = 0xAA00;
/// The userfaultfd device (Linux 6.1+).
pub const DEV_USERFAULTFD: &str = "/dev/userfaultfd";
/// `UFFDIO_COPY_MODE_WP` / `UFFDIO_CONTINUE_MODE_WP`: install the page write-protected.
const FILL_MODE_WP: u64 = 1 << 1;
/// `UFFDIO_COPY_MODE_DONTWAKE` / `UFFDIO_ZEROPAGE_MODE_DONTWAKE`: fill without waking.
const FILL_MODE_DONTWAKE: u64 = 1 << 0;

/// `UFFD_FEATURE_EVENT_REMAP`: a registered VMA moved by mremap keeps its registration
/// (and its write-protected PTEs); the mover waits until the event is read.
pub const FEATURE_EVENT_REMAP: u64 = 1 << 2;
/// `UFFD_FEATURE_EVENT_REMOVE`: `MADV_DONTNEED`/`MADV_REMOVE` on a registered range is
/// reported ([`Event::Remove`]); the caller of `madvise` waits until the event is read.
pub const FEATURE_EVENT_REMOVE: u64 = 1 << 3;
/// `UFFD_FEATURE_MISSING_SHMEM`.
pub const FEATURE_MISSING_SHMEM: u64 = 1 << 5;
/// `UFFD_FEATURE_MINOR_SHMEM`: minor faults (page in the page cache, no PTE) on shmem.
pub const FEATURE_MINOR_SHMEM: u64 = 1 << 10;
/// `UFFD_FEATURE_THREAD_ID`: fault messages carry the faulting thread.
pub const FEATURE_THREAD_ID: u64 = 1 << 8;
/// `UFFD_FEATURE_WP_HUGETLBFS_SHMEM`: write-protect on shmem, kept across zaps.
pub const FEATURE_WP_SHMEM: u64 = 1 << 12;

/// `UFFD_FEATURE_WP_ASYNC` (Linux 6.7+): write-protect faults resolved by the kernel
/// itself (the page unprotected, no message, no wait); `PAGEMAP_SCAN`'s
/// `PAGE_IS_WRITTEN` then tells which pages were written. Per userfaultfd: every
/// write-protect fault of its ranges is then asynchronous.
pub const FEATURE_WP_ASYNC: u64 = 1 << 15;

/// Every feature memfold's agent opens its userfaultfd with: remap and remove events,
/// missing, write-protect and minor faults on shmem, the faulting thread's id. `memfold
/// run` checks the same set before any guest boots.
pub const AGENT_FEATURES: u64 = FEATURE_EVENT_REMAP
    | FEATURE_EVENT_REMOVE
    | FEATURE_MISSING_SHMEM
    | FEATURE_WP_SHMEM
    | FEATURE_MINOR_SHMEM
    | FEATURE_THREAD_ID;

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
/// `UFFD_EVENT_REMOVE`.
const EVENT_REMOVE: u8 = 0x15;
/// How often an ioctl refused with `EAGAIN` (a non-cooperative event not yet read) is
/// tried again, the pending events read in between (yielding when none came yet).
const AGAIN_TRIES: u32 = 100_000;
/// The unit a fill goes page by page in: shmem's base page, bytes (guest RAM here is
/// memfd shmem, never hugetlbfs).
const FILL_PAGE: u64 = 4096;
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

/// `struct uffd_msg`: 32 bytes, the event in byte 0, then three u64 arguments from
/// byte 8 (for a page fault: flags, address, thread id).
const MSG_BYTES: usize = 32;

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
        /// The faulting thread's id, as that thread sees it (`UFFD_FEATURE_THREAD_ID`; 0
        /// without it): for a write through `process_vm_writev`, the writer's thread in
        /// its own process, not one of this process's.
        tid: u32,
    },
    /// A registered range moved (mremap); reading this lets the mover continue.
    Remap,
    /// `MADV_DONTNEED` or `MADV_REMOVE` dropped `[start, end)` of a registered range (its
    /// PTEs; for `MADV_REMOVE` its file pages too); reading this lets the caller continue.
    Remove {
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
    },
    /// Another event (fork, unmap): nothing to do for memfold.
    Other(u8),
}

/// Which userfaultfd ioctl failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ioctl {
    /// `UFFDIO_API`: the handshake that enables features.
    Api,
    /// `UFFDIO_REGISTER`.
    Register,
    /// `UFFDIO_WRITEPROTECT`.
    WriteProtect,
    /// `UFFDIO_WAKE`.
    Wake,
    /// `UFFDIO_COPY`.
    Copy,
    /// `UFFDIO_ZEROPAGE`.
    Zeropage,
    /// `UFFDIO_CONTINUE`.
    Continue,
}

impl fmt::Display for Ioctl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Ioctl::Api => "UFFDIO_API",
            Ioctl::Register => "UFFDIO_REGISTER",
            Ioctl::WriteProtect => "UFFDIO_WRITEPROTECT",
            Ioctl::Wake => "UFFDIO_WAKE",
            Ioctl::Copy => "UFFDIO_COPY",
            Ioctl::Zeropage => "UFFDIO_ZEROPAGE",
            Ioctl::Continue => "UFFDIO_CONTINUE",
        })
    }
}

/// Userfaultfd errors.
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    /// No userfaultfd for kernel faults: the `userfaultfd` syscall was refused (it needs
    /// CAP_SYS_PTRACE or sysctl vm.unprivileged_userfaultfd = 1) and so was
    /// `/dev/userfaultfd` (its file mode decides, Linux 6.1+).
    #[error("userfaultfd: {0} (memfold's agent needs a userfaultfd for kernel faults: QEMU as root or with CAP_SYS_PTRACE, or read-write access to /dev/userfaultfd for QEMU's user or group, or sysctl vm.unprivileged_userfaultfd = 1; docs/operations.md)")]
    Open(#[source] io::Error),
    /// `UFFDIO_API` failed.
    #[error("UFFDIO_API with features {features:#x}: {errno}")]
    Api {
        /// The features asked for.
        features: u64,
        /// The kernel's error.
        #[source]
        errno: io::Error,
    },
    /// The kernel lacks features memfold asked for.
    #[error("userfaultfd features {missing:#x} missing (kernel has {available:#x})")]
    MissingFeatures {
        /// The missing feature bits.
        missing: u64,
        /// Every feature the kernel has.
        available: u64,
    },
    /// An ioctl on a range failed.
    #[error("{ioctl} at {start:#x} (+{len:#x}): {errno}")]
    Ioctl {
        /// Which ioctl.
        ioctl: Ioctl,
        /// Start of the range.
        start: u64,
        /// Length of the range, bytes.
        len: u64,
        /// The kernel's error.
        #[source]
        errno: io::Error,
    },
    /// Reading an event failed (other than "nothing pending").
    #[error("reading a userfaultfd event: {0}")]
    Read(#[source] io::Error),
    /// The kernel returned a message shorter than `struct uffd_msg`.
    #[error("short userfaultfd message: {0} bytes")]
    ShortMessage(usize),
}

impl UffdError {
    /// The OS error number, if the kernel refused something.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            UffdError::Open(e) | UffdError::Read(e) => e.raw_os_error(),
            UffdError::Api { errno, .. } | UffdError::Ioctl { errno, .. } => errno.raw_os_error(),
            UffdError::MissingFeatures { .. } | UffdError::ShortMessage(_) => None,
        }
    }
}

impl From<UffdError> for io::Error {
    fn from(e: UffdError) -> io::Error {
        let kind = match &e {
            UffdError::Open(e) | UffdError::Read(e) => e.kind(),
            UffdError::Api { errno, .. } | UffdError::Ioctl { errno, .. } => errno.kind(),
            UffdError::MissingFeatures { .. } => io::ErrorKind::Unsupported,
            UffdError::ShortMessage(_) => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, e)
    }
}

/// A userfaultfd in this process.
///
/// While a non-cooperative event (remove, remap) is queued unread, the kernel refuses
/// the ioctls that change pages with `EAGAIN` (`mmap_changing`). Each ioctl here then
/// reads the pending events into a backlog, which [`Uffd::read_event`] returns first, and
/// tries again: no event is lost or reordered, and callers see `EAGAIN` only if the
/// kernel still refuses after `AGAIN_TRIES` tries.
#[derive(Debug)]
pub struct Uffd {
    fd: OwnedFd,
    backlog: Mutex<VecDeque<Event>>,
}

impl Uffd {
    /// Opens a userfaultfd (non-blocking, close-on-exec) for all faults, kernel ones
    /// included (not `UFFD_USER_MODE_ONLY`: the kernel's writes into guest RAM for QEMU's
    /// disk threads must reach us too), and enables `features`.
    ///
    /// The syscall first; where it is refused (`EPERM`: no CAP_SYS_PTRACE and sysctl
    /// vm.unprivileged_userfaultfd = 0, as for QEMU under libvirt's own user),
    /// `/dev/userfaultfd`, whose file mode is the operator's grant (QEMU does the same for
    /// postcopy migration).
    ///
    /// Errors: both are refused ([`UffdError::Open`], the syscall's error), or a
    /// requested feature is not available ([`UffdError::MissingFeatures`] names the bits).
    pub fn open(features: u64) -> Result<Uffd, UffdError> {
        // SAFETY: the call itself has no preconditions; what makes a userfaultfd
        // dangerous is registering memory with it, which `register` guards.
        let fd = match unsafe {
            rustix::mm::userfaultfd(UserfaultfdFlags::CLOEXEC | UserfaultfdFlags::NONBLOCK)
        } {
            Ok(fd) => fd,
            Err(e) if e == rustix::io::Errno::PERM => {
                Self::open_device(DEV_USERFAULTFD).map_err(|_| UffdError::Open(e.into()))?
            }
            Err(e) => return Err(UffdError::Open(e.into())),
        };
        Self::api(fd, features)
    }

    /// A userfaultfd from the device at `path` (`/dev/userfaultfd`; ioctl
    /// `USERFAULTFD_IOC_NEW`), non-blocking and close-on-exec, handling kernel faults
    /// whatever vm.unprivileged_userfaultfd says. Public for its test.
    ///
    /// Errors: the device cannot be opened (absent before Linux 6.1, or its mode refuses
    /// this process) or the ioctl fails.
    pub fn open_device(path: &str) -> io::Result<OwnedFd> {
        let dev = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        // SAFETY: USERFAULTFD_IOC_NEW takes its flags by value and returns a new
        // descriptor, which nothing else owns.
        let fd = unsafe {
            libc::ioctl(
                dev.as_raw_fd(),
                USERFAULTFD_IOC_NEW,
                libc::O_CLOEXEC | libc::O_NONBLOCK,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a new descriptor of ours (checked non-negative above).
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// `UFFDIO_API` on a new userfaultfd: enables `features`.
    fn api(fd: OwnedFd, features: u64) -> Result<Uffd, UffdError> {
        let mut api = UffdioApi {
            api: 0xAA,
            features,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API reads and writes the `UffdioApi` it is given, which lives
        // across the call.
        if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) } != 0 {
            return Err(UffdError::Api {
                features,
                errno: io::Error::last_os_error(),
            });
        }
        // The kernel answers with every feature it has; ours must be among them.
        if api.features & features != features {
            return Err(UffdError::MissingFeatures {
                missing: features & !api.features,
                available: api.features,
            });
        }
        Ok(Uffd {
            fd,
            backlog: Mutex::new(VecDeque::new()),
        })
    }

    /// `ioctl(req, arg)`, tried again while the kernel refuses it with `EAGAIN` (see
    /// [`Uffd`]); returns the last result, `errno` set as the kernel left it. For the
    /// ioctls that act on a whole range or not at all (write-protect, wake); the fills,
    /// which can stop part way, go through [`Uffd::fill`].
    ///
    /// # Safety
    ///
    /// `arg` is the argument struct request `req` reads and writes, and what `req` does
    /// to memory is the caller's to vouch for.
    unsafe fn ioctl<T>(&self, req: libc::c_ulong, arg: &mut T) -> libc::c_int {
        let mut rc = -1;
        for _ in 0..AGAIN_TRIES {
            // SAFETY: the caller's contract; `arg` lives across the call.
            rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), req, arg as *mut T) };
            if rc == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EAGAIN) {
                return rc;
            }
            self.let_the_kernel_go_on();
            // SAFETY: sets this thread's errno, so the caller sees the EAGAIN if the last try fails.
            unsafe { *libc::__errno_location() = libc::EAGAIN };
        }
        rc
    }

    /// After an `EAGAIN` for a non-cooperative event not yet read: reads the pending
    /// events into the backlog (what lets the kernel go on), or yields if none came yet.
    fn let_the_kernel_go_on(&self) {
        let mut queued = false;
        while let Ok(Some(ev)) = self.read_raw() {
            self.backlog
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push_back(ev);
            queued = true;
        }
        if !queued {
            std::thread::yield_now();
        }
    }

    /// A fill ioctl `req` (`UFFDIO_COPY`, `_ZEROPAGE`, `_CONTINUE`) over `[dst, dst+len)`,
    /// carried to the end of the range: `make(off)` is its argument for `[dst+off,
    /// dst+len)`, `count` the bytes the kernel says it filled (its `copy`, `zeropage` or
    /// `mapped` field).
    ///
    /// The kernel fills page by page and stops at the first page it cannot fill; having
    /// filled some it says `EAGAIN` with their count, as it does (count 0 or `-EAGAIN`)
    /// while a non-cooperative event waits unread. So: a count > 0 goes on after what
    /// was filled; a page filled meanwhile (`EEXIST`) is woken unless `mode` says
    /// `DONTWAKE`, and passed; a bare `EAGAIN` reads the events and tries again. Taking a
    /// partial fill's `EAGAIN` for the event case tried the whole range again, whose
    /// first page then said `EEXIST`, and pages past the one that stopped it were left
    /// missing under an `Ok` (and an `ENOMEM` there hidden).
    ///
    /// Errors: any other refusal, naming the part of the range not filled; `EAGAIN`
    /// after [`AGAIN_TRIES`] tries.
    ///
    /// # Safety
    ///
    /// As [`Uffd::ioctl`], for every argument `make` builds.
    unsafe fn fill<T>(
        &self,
        req: libc::c_ulong,
        ioctl: Ioctl,
        (dst, len, mode): (u64, u64, u64),
        make: impl Fn(u64) -> T,
        count: impl Fn(&T) -> i64,
    ) -> Result<(), UffdError> {
        let mut off = 0;
        let mut again = 0;
        while off < len {
            let mut arg = make(off);
            // SAFETY: the caller's contract; `arg` lives across the call.
            let rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), req, &mut arg as *mut T) };
            if rc == 0 {
                return Ok(());
            }
            let errno = io::Error::last_os_error();
            let filled = count(&arg);
            if filled > 0 {
                // Woken already unless DONTWAKE; the page that stopped it comes next.
                off = (off + filled as u64).min(len);
                continue;
            }
            match errno.raw_os_error() {
                Some(libc::EAGAIN) if again < AGAIN_TRIES => {
                    again += 1;
                    self.let_the_kernel_go_on();
                }
                Some(libc::EEXIST) => {
                    if mode & FILL_MODE_DONTWAKE == 0 {
                        self.wake(dst + off, FILL_PAGE.min(len - off))?;
                    }
                    off += FILL_PAGE;
                }
                _ => {
                    return Err(UffdError::Ioctl {
                        ioctl,
                        start: dst + off,
                        len: len - off,
                        errno,
                    })
                }
            }
        }
        Ok(())
    }

    /// Registers `[start, start+len)` with `mode` ([`MODE_MISSING`], [`MODE_WP`],
    /// [`MODE_MINOR`], or'ed).
    ///
    /// Errors: the range is not page-aligned or not a mapping the mode supports.
    ///
    /// # Safety
    ///
    /// The range must be memory that no Rust reference or allocation of this program
    /// uses, such as a shared file mapping this process manages through raw addresses
    /// (guest RAM): once registered, [`Uffd::copy`], [`Uffd::zeropage`] and
    /// [`Uffd::cont`] change what its missing pages read as, and every access to a
    /// faulting page waits until this userfaultfd answers (a thread that holds the only
    /// handle waits forever).
    pub unsafe fn register(&self, start: u64, len: u64, mode: u64) -> Result<(), UffdError> {
        let mut r = UffdioRegister {
            range: UffdioRange { start, len },
            mode,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes the `UffdioRegister` it is given, which
        // lives across the call; the caller vouches for the range.
        let rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_REGISTER, &mut r) };
        check(rc, Ioctl::Register, start, len)
    }

    /// Write-protects (`protect`) or unprotects a registered range; unprotecting wakes
    /// threads waiting on it.
    ///
    /// Errors: the range is not registered with [`MODE_WP`].
    pub fn write_protect(&self, start: u64, len: u64, protect: bool) -> Result<(), UffdError> {
        let mut w = UffdioWriteprotect {
            range: UffdioRange { start, len },
            mode: protect as u64,
        };
        // SAFETY: UFFDIO_WRITEPROTECT reads and writes the `UffdioWriteprotect` it is
        // given, which lives across the call. It changes page protection only, never
        // contents, and only of registered ranges.
        let rc = unsafe { self.ioctl(UFFDIO_WRITEPROTECT, &mut w) };
        check(rc, Ioctl::WriteProtect, start, len)
    }

    /// Wakes threads waiting on faults in `[start, start+len)` so they retry.
    ///
    /// Errors: invalid range.
    pub fn wake(&self, start: u64, len: u64) -> Result<(), UffdError> {
        let mut r = UffdioRange { start, len };
        // SAFETY: UFFDIO_WAKE reads the `UffdioRange` it is given, which lives across the
        // call; waking changes no memory.
        let rc = unsafe { self.ioctl(UFFDIO_WAKE, &mut r) };
        check(rc, Ioctl::Wake, start, len)
    }

    /// Fills the missing page(s) at `[dst, dst+src.len())` with `src`, write-protected if
    /// `wp`, and wakes the waiting threads (`UFFDIO_COPY`). A page filled meanwhile
    /// (`EEXIST`) only wakes.
    ///
    /// Errors: `dst` is not a registered missing range; the host is out of memory.
    pub fn copy(&self, dst: u64, src: &[u8], wp: bool) -> Result<(), UffdError> {
        let len = src.len() as u64;
        let mode = if wp { FILL_MODE_WP } else { 0 };
        let make = |off: u64| UffdioCopy {
            dst: dst + off,
            src: src.as_ptr() as u64 + off,
            len: len - off,
            mode,
            copy: 0,
        };
        // SAFETY: UFFDIO_COPY reads `src` from `off` (valid to its end) and writes `copy`;
        // it fills only missing pages of a registered range, which `register`'s caller
        // vouched no Rust value uses.
        unsafe { self.fill(UFFDIO_COPY, Ioctl::Copy, (dst, len, mode), make, |c| c.copy) }
    }

    /// Fills the missing page(s) at `[dst, dst+len)` with zeros and wakes the waiting
    /// threads (`UFFDIO_ZEROPAGE`; on shmem this allocates a zeroed page). A page filled
    /// meanwhile (`EEXIST`) only wakes.
    ///
    /// Errors: `dst` is not a registered missing range; the host is out of memory.
    pub fn zeropage(&self, dst: u64, len: u64) -> Result<(), UffdError> {
        self.zeropage_mode(dst, len, 0)
    }

    /// [`Uffd::zeropage`] without waking the threads waiting on the range, not even for a
    /// page filled meanwhile (`EEXIST`): for fills of several ranges that must all be in
    /// place before a thread that faulted on one of them goes on; the caller wakes it.
    ///
    /// Errors: as [`Uffd::zeropage`].
    pub fn zeropage_dontwake(&self, dst: u64, len: u64) -> Result<(), UffdError> {
        self.zeropage_mode(dst, len, FILL_MODE_DONTWAKE)
    }

    fn zeropage_mode(&self, dst: u64, len: u64, mode: u64) -> Result<(), UffdError> {
        let make = |off: u64| UffdioZeropage {
            range: UffdioRange {
                start: dst + off,
                len: len - off,
            },
            mode,
            zeropage: 0,
        };
        // SAFETY: UFFDIO_ZEROPAGE reads the range and writes `zeropage`; it fills only
        // missing pages of a registered range (see `copy`).
        unsafe {
            self.fill(
                UFFDIO_ZEROPAGE,
                Ioctl::Zeropage,
                (dst, len, mode),
                make,
                |z| z.zeropage,
            )
        }
    }

    /// Maps the memfd's existing page(s) at `[dst, dst+len)` after a minor fault,
    /// write-protected if `wp`, and wakes the waiting threads (`UFFDIO_CONTINUE`). Already
    /// mapped (`EEXIST`) only wakes.
    ///
    /// Errors: `dst` is not a registered minor range.
    pub fn cont(&self, dst: u64, len: u64, wp: bool) -> Result<(), UffdError> {
        let mode = if wp { FILL_MODE_WP } else { 0 };
        let make = |off: u64| UffdioContinue {
            range: UffdioRange {
                start: dst + off,
                len: len - off,
            },
            mode,
            mapped: 0,
        };
        // SAFETY: UFFDIO_CONTINUE reads the range and writes `mapped`; it maps pages the
        // file already holds into a registered range (see `copy`).
        unsafe {
            self.fill(
                UFFDIO_CONTINUE,
                Ioctl::Continue,
                (dst, len, mode),
                make,
                |c| c.mapped,
            )
        }
    }

    /// Whether events an ioctl read while it waited are queued here: the descriptor no
    /// longer polls readable for them, so a caller about to poll should not wait.
    pub fn has_backlog(&self) -> bool {
        !self
            .backlog
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
    }

    /// Reads one event if one is pending (the fd is non-blocking): first those an ioctl
    /// read while it waited (see [`Uffd`]).
    ///
    /// Errors: read failures other than "nothing pending".
    pub fn read_event(&self) -> Result<Option<Event>, UffdError> {
        if let Some(ev) = self
            .backlog
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front()
        {
            return Ok(Some(ev));
        }
        self.read_raw()
    }

    /// Reads one event from the kernel if one is pending.
    fn read_raw(&self) -> Result<Option<Event>, UffdError> {
        let mut m = [0u8; MSG_BYTES];
        let n = match rustix::io::read(&self.fd, &mut m) {
            Ok(n) => n,
            Err(rustix::io::Errno::AGAIN) => return Ok(None),
            Err(e) => return Err(UffdError::Read(e.into())),
        };
        if n != MSG_BYTES {
            return Err(UffdError::ShortMessage(n));
        }
        let arg =
            |i: usize| u64::from_ne_bytes(m[8 + 8 * i..16 + 8 * i].try_into().expect("8 bytes"));
        Ok(Some(match m[0] {
            EVENT_PAGEFAULT => Event::Fault {
                addr: arg(1),
                write: arg(0) & PAGEFAULT_FLAG_WRITE != 0,
                wp: arg(0) & PAGEFAULT_FLAG_WP != 0,
                minor: arg(0) & PAGEFAULT_FLAG_MINOR != 0,
                tid: u32::from_ne_bytes(m[24..28].try_into().expect("4 bytes")),
            },
            EVENT_REMAP => Event::Remap,
            EVENT_REMOVE => Event::Remove {
                start: arg(0),
                end: arg(1),
            },
            other => Event::Other(other),
        }))
    }
}

/// Every userfaultfd feature this kernel has (`UFFDIO_API` with none asked answers with
/// all of them), on a userfaultfd opened for the probe and closed again.
///
/// Errors: no userfaultfd for this process ([`UffdError::Open`]), or the handshake fails.
pub fn available_features() -> Result<u64, UffdError> {
    let mut api = UffdioApi {
        api: 0xAA,
        features: 0,
        ioctls: 0,
    };
    // SAFETY: the call has no preconditions; the descriptor is only handshaken and closed.
    let fd = match unsafe {
        rustix::mm::userfaultfd(UserfaultfdFlags::CLOEXEC | UserfaultfdFlags::NONBLOCK)
    } {
        Ok(fd) => fd,
        Err(e) if e == rustix::io::Errno::PERM => {
            Uffd::open_device(DEV_USERFAULTFD).map_err(|_| UffdError::Open(e.into()))?
        }
        Err(e) => return Err(UffdError::Open(e.into())),
    };
    // SAFETY: UFFDIO_API reads and writes the `UffdioApi` it is given, which lives across
    // the call.
    if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) } != 0 {
        return Err(UffdError::Api {
            features: 0,
            errno: io::Error::last_os_error(),
        });
    }
    Ok(api.features)
}

/// The result of a range ioctl.
fn check(rc: libc::c_int, ioctl: Ioctl, start: u64, len: u64) -> Result<(), UffdError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(UffdError::Ioctl {
            ioctl,
            start,
            len,
            errno: io::Error::last_os_error(),
        })
    }
}

impl AsFd for Uffd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Uffd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests;
