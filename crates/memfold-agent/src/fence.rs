//! The agent's side of the write fence (`memfold_sys::fence`): the fence itself, made
//! before QEMU's `main`, and QEMU's own reads into guest RAM held in it.
//!
//! With `cache.direct=on` (`cache=none`) and `aio=threads` (QEMU's default), QEMU's
//! worker threads read disk blocks straight into guest RAM with `pread`/`preadv`: the
//! kernel pins the pages and the disk's data lands in them later, before the call
//! returns — the same pin-then-copy window as a device's `process_vm_writev`. The agent
//! is preloaded into QEMU, so it interposes these calls (the symbols below win over
//! libc's) and holds the fence over their buffers for the call. A buffered read copies
//! through the page tables and needs no fence; holding it costs an atomic per 64 KiB.
//!
//! `aio=native` reads land after `io_submit` has returned, and QEMU reaps them from a
//! ring in its own memory, with no call to hold the fence across: the agent interposes
//! `io_submit` too and, before the first read it submits, closes the fence for good
//! (`WriteFence::close`): the agent takes no page of this guest again, and what it holds
//! stays safe (a pin of such a page faults). Drives the agent sees on QEMU's command line
//! as `aio=native` it refuses at the start instead (`qemu_args`), and so it does
//! `aio=io_uring` with direct I/O, whose submissions (liburing's own system calls) no
//! symbol can catch. Not covered: an `io_uring` direct drive added later over QMP
//! (`blockdev-add`), which docs/security.md names.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use memfold_sys::fence::{FenceHold, WriteFence};

static FENCE: OnceLock<Option<WriteFence>> = OnceLock::new();

/// This process's write fence, made on first use: the agent's constructor makes it
/// before QEMU's `main`, so every device that writes guest RAM from another process
/// finds it when QEMU connects. `None` if it cannot be made (then the agent does not
/// start).
pub fn write_fence() -> Option<&'static WriteFence> {
    FENCE
        .get_or_init(|| match WriteFence::create() {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::error!("the write fence: {e}");
                None
            }
        })
        .as_ref()
}

/// Holds the fence, if made, over `(address, length)` ranges. Never makes it: a read
/// before the agent started needs none (nothing is shared yet).
fn hold(ranges: impl IntoIterator<Item = (u64, u64)>) -> Option<FenceHold<'static>> {
    FENCE.get()?.as_ref().map(|f| f.hold(ranges))
}

/// The ranges of `cnt` iovecs at `iov`.
///
/// # Safety
/// `iov` points to `cnt` iovecs (the caller's call would read them anyway).
unsafe fn iov_ranges(iov: *const libc::iovec, cnt: c_int) -> Vec<(u64, u64)> {
    // Past IOV_MAX libc fails the call (EINVAL) without reading them: nor do we.
    if iov.is_null() || cnt <= 0 || cnt > 1024 {
        return Vec::new();
    }
    // SAFETY: the caller's promise.
    let v = unsafe { std::slice::from_raw_parts(iov, cnt as usize) };
    v.iter()
        .map(|i| (i.iov_base as u64, i.iov_len as u64))
        .collect()
}

/// libc's definition of `name` (the next in lookup order after this library's).
fn next_symbol(name: &std::ffi::CStr) -> *mut c_void {
    // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name has no other precondition.
    unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) }
}

macro_rules! real {
    ($name:literal, $ty:ty) => {{
        static REAL: OnceLock<usize> = OnceLock::new();
        let p = *REAL.get_or_init(|| next_symbol($name) as usize);
        if p == 0 {
            None
        } else {
            // SAFETY: libc's symbol of that name has this C signature.
            Some(unsafe { std::mem::transmute::<usize, $ty>(p) })
        }
    }};
}

type Pread = unsafe extern "C" fn(c_int, *mut c_void, usize, libc::off_t) -> isize;
type Preadv = unsafe extern "C" fn(c_int, *const libc::iovec, c_int, libc::off_t) -> isize;
type Preadv2 = unsafe extern "C" fn(c_int, *const libc::iovec, c_int, libc::off_t, c_int) -> isize;
type PreadChk = unsafe extern "C" fn(c_int, *mut c_void, usize, libc::off_t, usize) -> isize;

/// No libc definition found: fail as the call can.
fn enosys() -> isize {
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = libc::ENOSYS };
    -1
}

/// An interposed `pread`-shaped call (`$buflen`: the fortified `__pread_chk` form, with
/// the buffer's size after the offset): holds the fence over its buffer for the call.
macro_rules! pread_like {
    ($name:ident, $sym:literal, $ty:ty $(, $buflen:ident)?) => {
        #[doc = concat!("`", stringify!($name), "`, held in the write fence over its buffer.")]
        ///
        /// # Safety
        /// As libc's.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            fd: c_int,
            buf: *mut c_void,
            n: usize,
            off: libc::off_t,
            $($buflen: usize,)?
        ) -> isize {
            let _held = hold([(buf as u64, n as u64)]);
            match real!($sym, $ty) {
                // SAFETY: the caller's arguments, to libc's call of the same name.
                Some(f) => unsafe { f(fd, buf, n, off $(, $buflen)?) },
                None => enosys(),
            }
        }
    };
}

/// An interposed `preadv`-shaped call (`$flags`: with `preadv2`'s flags): holds the
/// fence over its buffers for the call.
macro_rules! preadv_like {
    ($name:ident, $sym:literal, $ty:ty $(, $flags:ident)?) => {
        #[doc = concat!("`", stringify!($name), "`, held in the write fence over its buffers.")]
        ///
        /// # Safety
        /// As libc's.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            fd: c_int,
            iov: *const libc::iovec,
            cnt: c_int,
            off: libc::off_t,
            $($flags: c_int,)?
        ) -> isize {
            // SAFETY: the caller's iovecs.
            let _held = hold(unsafe { iov_ranges(iov, cnt) });
            match real!($sym, $ty) {
                // SAFETY: the caller's arguments, to libc's call of the same name.
                Some(f) => unsafe { f(fd, iov, cnt, off $(, $flags)?) },
                None => enosys(),
            }
        }
    };
}

pread_like!(pread, c"pread", Pread);
pread_like!(pread64, c"pread64", Pread);
pread_like!(__pread_chk, c"__pread_chk", PreadChk, buflen);
pread_like!(__pread64_chk, c"__pread64_chk", PreadChk, buflen);
preadv_like!(preadv, c"preadv", Preadv);
preadv_like!(preadv64, c"preadv64", Preadv);
preadv_like!(preadv2, c"preadv2", Preadv2, flags);
preadv_like!(preadv64v2, c"preadv64v2", Preadv2, flags);

/// The kernel's `struct iocb` (`linux/aio_abi.h`, little-endian x86_64 layout), as far
/// as the opcode.
#[repr(C)]
struct Iocb {
    data: u64,
    key: u32,
    rw_flags: u32,
    opcode: u16,
}

/// `IOCB_CMD_PREAD` and `IOCB_CMD_PREADV`: reads into memory.
const IOCB_READS: [u16; 2] = [0, 7];

/// Whether any of the `nr` iocbs at `ios` reads into memory.
///
/// # Safety
/// `ios` points to `nr` pointers, each null or to an iocb. libaio's contract: the kernel
/// reads them too, but would stop at its context's size or the first bad pointer with
/// `EFAULT`, where a caller breaking the contract faults here (QEMU's calls keep it).
unsafe fn reads_into_memory(nr: libc::c_long, ios: *const *const Iocb) -> bool {
    if ios.is_null() || nr <= 0 {
        return false;
    }
    // SAFETY: the caller's promise.
    let v = unsafe { std::slice::from_raw_parts(ios, nr as usize) };
    v.iter().any(|&io| {
        // SAFETY: the caller's promise: null or an iocb.
        !io.is_null() && IOCB_READS.contains(&unsafe { (*io).opcode })
    })
}

/// libaio's `io_submit` (QEMU's `aio=native`), the system call it wraps, after closing the
/// write fence if a read is among the iocbs (see the module): its data lands after this
/// returns, where no hold reaches. Returns what libaio's does: the number submitted, or a
/// negative errno.
///
/// # Safety
/// As libaio's: `ios` points to `nr` iocb pointers.
#[no_mangle]
pub unsafe extern "C" fn io_submit(
    ctx: libc::c_ulong,
    nr: libc::c_long,
    ios: *const *const c_void,
) -> c_int {
    // SAFETY: the caller's iocbs; Iocb is a prefix of the kernel's struct.
    if unsafe { reads_into_memory(nr, ios.cast()) } {
        if let Some(Some(f)) = FENCE.get() {
            if !f.is_closed() {
                tracing::warn!(
                    "QEMU submitted a native AIO read (aio=native), which lands after its call returns, beyond the write fence: memfold takes no more pages of this guest (those it holds stay safe); use aio=threads"
                );
                f.close();
            }
        }
    }
    // SAFETY: the caller's arguments, to the system call libaio's io_submit makes.
    let r = unsafe { libc::syscall(libc::SYS_io_submit, ctx, nr, ios) };
    if r < 0 {
        // SAFETY: errno is this thread's.
        -unsafe { *libc::__errno_location() }
    } else {
        r as c_int
    }
}
