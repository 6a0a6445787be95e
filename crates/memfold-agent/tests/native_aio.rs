//! A native AIO read (QEMU's `aio=native`) closes the write fence for good. Its data lands
//! after `io_submit` returns, and QEMU reaps it from a ring in its own memory, so no hold
//! can cover it: the agent's `io_submit` closes the fence before the first read, and from
//! then on the agent takes no page (every share comes back "changed"). The invariant:
//! **no page is taken after a read the fence cannot cover was submitted**.
//!
//! Its own test binary: closing the fence is for the whole process. Seen failing with
//! the close removed from `io_submit`: the second share succeeds.

mod common;

use std::io::Write;
use std::os::fd::AsRawFd;

use common::{agent_with_pool, page_of, region, share, write};
use memfold_codecs::PAGE_SIZE;
use memfold_wire::{BatchId, FrameId, Gfn};

/// Guest RAM, pages.
const PAGES: usize = 8;

/// The kernel's `struct iocb` (`linux/aio_abi.h`, x86_64).
#[repr(C)]
#[derive(Default)]
struct Iocb {
    data: u64,
    key: u32,
    rw_flags: u32,
    opcode: u16,
    reqprio: i16,
    fildes: u32,
    buf: u64,
    nbytes: u64,
    offset: i64,
    reserved2: u64,
    flags: u32,
    resfd: u32,
}

/// The kernel's `struct io_event`.
#[repr(C)]
#[derive(Default)]
struct IoEvent {
    data: u64,
    obj: u64,
    res: i64,
    res2: i64,
}

#[test]
fn a_native_aio_read_closes_the_fence_and_the_agent_takes_no_page_after() {
    let (_fd, ptr) = region(PAGES);
    let page = |g: usize| vec![g as u8 + 1; PAGE_SIZE];
    for g in 0..PAGES {
        write(ptr, g, &page(g));
    }
    let dir = tempfile::tempdir().unwrap();
    let (c, _pool, _store) =
        agent_with_pool(&dir.path().join("memfoldd.sock"), &[page(1), page(4)]);

    // Before: the agent shares.
    let (shared, _, changed) = share(&c, BatchId(1), vec![(Gfn(1), FrameId(0))]);
    assert_eq!((shared, changed), (vec![Gfn(1)], vec![]));

    // A native AIO read of a file into guest page 3, through the agent's io_submit (the
    // symbol QEMU's libaio call resolves to when the agent is preloaded).
    let disk = vec![0x5au8; PAGE_SIZE];
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(&disk).unwrap();
    file.flush().unwrap();
    let mut ctx: libc::c_ulong = 0;
    // SAFETY: io_setup writes the new context into ctx, which lives across the call.
    let r = unsafe { libc::syscall(libc::SYS_io_setup, 4, &mut ctx as *mut libc::c_ulong) };
    assert_eq!(r, 0);
    let iocb = Iocb {
        opcode: 0, // IOCB_CMD_PREAD
        fildes: file.as_file().as_raw_fd() as u32,
        // SAFETY: page 3 of the region.
        buf: unsafe { ptr.add(3 * PAGE_SIZE) } as u64,
        nbytes: PAGE_SIZE as u64,
        ..Iocb::default()
    };
    let list = [&iocb as *const Iocb as *const libc::c_void];
    // SAFETY: one valid iocb whose buffer is a page of this process.
    let n = unsafe { memfold_agent::fence::io_submit(ctx, 1, list.as_ptr()) };
    assert_eq!(n, 1, "submitted");
    let mut ev = IoEvent::default();
    // SAFETY: room for one event.
    let got = unsafe {
        libc::syscall(
            libc::SYS_io_getevents,
            ctx,
            1,
            1,
            &mut ev as *mut IoEvent,
            std::ptr::null::<libc::timespec>(),
        )
    };
    assert_eq!((got, ev.res), (1, PAGE_SIZE as i64));
    // SAFETY: the context made above.
    unsafe { libc::syscall(libc::SYS_io_destroy, ctx) };
    assert_eq!(page_of(ptr, 3), disk, "the read landed");

    // After: no page is taken, though page 4 still equals frame 1.
    let (shared, _, changed) = share(&c, BatchId(2), vec![(Gfn(4), FrameId(1))]);
    assert_eq!((shared, changed), (vec![], vec![Gfn(4)]), "left alone");
    assert_eq!(page_of(ptr, 4), page(4));
    // What was taken before stays the guest's.
    assert_eq!(page_of(ptr, 1), page(1));
    write(ptr, 1, &page(7));
    assert_eq!(page_of(ptr, 1), page(7), "a CoW break still works");
}
