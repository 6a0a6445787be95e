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
//! Not covered: `aio=native` and `aio=io_uring` with direct I/O, whose data lands after
//! the submitting call has returned; the agent warns about such drives (`qemu_args`).

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

/// No libc definition found: fail as the call can.
fn enosys() -> isize {
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = libc::ENOSYS };
    -1
}

/// An interposed `pread`-shaped call: holds the fence over its buffer for the call.
macro_rules! pread_like {
    ($name:ident, $sym:literal) => {
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
        ) -> isize {
            let _held = hold([(buf as u64, n as u64)]);
            match real!($sym, Pread) {
                // SAFETY: the caller's arguments, to libc's call of the same name.
                Some(f) => unsafe { f(fd, buf, n, off) },
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

pread_like!(pread, c"pread");
pread_like!(pread64, c"pread64");
preadv_like!(preadv, c"preadv", Preadv);
preadv_like!(preadv64, c"preadv64", Preadv);
preadv_like!(preadv2, c"preadv2", Preadv2, flags);
preadv_like!(preadv64v2, c"preadv64v2", Preadv2, flags);
