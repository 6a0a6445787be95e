//! A write pinned before the agent's write-protection is never lost. A block device in
//! its own process writes guest RAM with `process_vm_writev`, which pins the target
//! pages and copies into them after: a page write-protected in between takes the copy
//! without a fault. Were the agent then to map a frame over the page (a share), or punch
//! it out (a zero page reclaimed, a page stashed), the copy would land in a page the
//! guest no longer sees, and the guest would read the old bytes. The invariant, kept by
//! the write fence (`memfold_sys::fence`): **the agent leaves alone every page a writer
//! holds in the fence**, and the writer's bytes are what the guest reads.
//!
//! The test holds a writer between its pin and its copy: the copy's *source* is a page
//! of this process registered with a second userfaultfd (missing), whose fault the test
//! answers only after the agent has answered its request. Seen failing with the agent's
//! fence check removed: the share and the reclaim succeed and the guest reads the old
//! bytes. A free-page watch of a held page is refused (and its discard then leaves it).

mod common;

use std::os::fd::AsFd;
use std::time::Duration;

use common::{agent_with_pool, next, page_of, region, share, watch, write};
use memfold_codecs::PAGE_SIZE;
use memfold_sys::fence::WriteFence;
use memfold_sys::uffd::HeldPage;
use memfold_wire::{BatchId, FrameId, Gfn, ToAgent, ToDaemon};

/// Guest RAM, pages.
const PAGES: usize = 8;

/// A writer in another process: holds the fence over its target, then copies `src` (a
/// page of this process) over the page at `dst` through the page tables.
fn remote_write(fence: &WriteFence, src: u64, dst: u64) -> isize {
    let _hold = fence.hold([(dst, PAGE_SIZE as u64)]);
    let local = libc::iovec {
        iov_base: src as *mut libc::c_void,
        iov_len: PAGE_SIZE,
    };
    let remote = libc::iovec {
        iov_base: dst as *mut libc::c_void,
        iov_len: PAGE_SIZE,
    };
    // SAFETY: one local iovec over the source page (mapped, registered: a fault waits for
    // the test) and one remote over guest RAM; the kernel checks both.
    unsafe { libc::process_vm_writev(libc::getpid(), &local, 1, &remote, 1, 0) }
}

/// Starts a remote write of `bytes` over page `g` of `ptr` and returns once the writer
/// has pinned the page and waits in its copy; `release` lets the copy go on.
fn pinned_write(
    fence: &'static WriteFence,
    ptr: *mut u8,
    g: usize,
    bytes: Vec<u8>,
) -> (impl FnOnce() -> HeldPage, std::thread::JoinHandle<isize>) {
    let held = HeldPage::new().unwrap();
    let src = held.addr();
    let dst = ptr as u64 + (g * PAGE_SIZE) as u64;
    let writer = std::thread::spawn(move || remote_write(fence, src, dst));
    assert!(
        held.wait_for_access(Duration::from_secs(10)).unwrap(),
        "the writer never faulted"
    );
    let bytes: [u8; PAGE_SIZE] = bytes.try_into().unwrap();
    // Returns the page: the caller keeps it until the writer has returned.
    let release = move || {
        held.release(&bytes).unwrap();
        held
    };
    (release, writer)
}

#[test]
fn a_write_pinned_before_the_agent_protects_a_page_is_never_lost() {
    let (_fd, ptr) = region(PAGES);
    let old = |g: usize| vec![g as u8 + 1; PAGE_SIZE];
    for g in 0..PAGES {
        write(ptr, g, &old(g));
    }
    // Page 2 is a free page of zeros.
    write(ptr, 2, &vec![0u8; PAGE_SIZE]);
    let dir = tempfile::tempdir().unwrap();
    // Frame 0 holds page 1's old bytes: a share of page 1 onto it passes the compare.
    let (c, _pool, _store) = agent_with_pool(&dir.path().join("memfoldd.sock"), &[old(1)]);
    let fence: &'static WriteFence = Box::leak(Box::new(
        WriteFence::of_process(
            rustix::process::pidfd_open(
                rustix::process::getpid(),
                rustix::process::PidfdFlags::empty(),
            )
            .unwrap()
            .as_fd(),
            std::process::id(),
        )
        .unwrap()
        .expect("the agent made this process's fence"),
    ));

    // A share over a page whose new bytes are on their way.
    let new1 = vec![0xa1u8; PAGE_SIZE];
    let (release, writer) = pinned_write(fence, ptr, 1, new1.clone());
    let (shared, _, changed) = share(&c, BatchId(1), vec![(Gfn(1), FrameId(0))]);
    let _src = release();
    assert_eq!(writer.join().unwrap(), PAGE_SIZE as isize);
    assert_eq!((shared, changed), (vec![], vec![Gfn(1)]), "left alone");
    assert_eq!(page_of(ptr, 1), new1, "the device's bytes, not the frame's");

    // A zero-page reclaim over a zero page being written.
    let new2 = vec![0xb2u8; PAGE_SIZE];
    let (release, writer) = pinned_write(fence, ptr, 2, new2.clone());
    c.send(
        &ToAgent::ReclaimZero {
            batch: BatchId(2),
            gfns: vec![Gfn(2)],
        },
        &[],
    )
    .unwrap();
    let reclaimed = next(&c, |m| match m {
        ToDaemon::ReclaimDone {
            batch, reclaimed, ..
        } if *batch == BatchId(2) => Some(reclaimed.clone()),
        _ => None,
    });
    let _src = release();
    assert_eq!(writer.join().unwrap(), PAGE_SIZE as isize);
    assert_eq!(reclaimed, vec![], "left alone");
    assert_eq!(page_of(ptr, 2), new2, "the device's bytes, not zeros");

    // A free-page watch over a page being written (issue 17): refused, so no discard
    // can punch it out later and lose the device's bytes.
    let new4 = vec![0xc4u8; PAGE_SIZE];
    let (release, writer) = pinned_write(fence, ptr, 4, new4.clone());
    let held = watch(&c, 5, &[4]);
    let _src = release();
    assert_eq!(writer.join().unwrap(), PAGE_SIZE as isize);
    assert_eq!(held, (vec![], vec![Gfn(4)]), "the held page is not watched");
    // (The fence holds whole chunks: page 5 is watched once the writer let go.)
    assert_eq!(watch(&c, 6, &[5]), (vec![Gfn(5)], vec![]));
    c.send(
        &ToAgent::DiscardFree {
            batch: BatchId(7),
            gfns: vec![Gfn(4), Gfn(5)],
        },
        &[],
    )
    .unwrap();
    let discarded = next(&c, |m| match m {
        ToDaemon::DiscardDone {
            batch, discarded, ..
        } if *batch == BatchId(7) => Some(discarded.clone()),
        _ => None,
    });
    assert_eq!(discarded, vec![Gfn(5)], "only the watched page");
    assert_eq!(page_of(ptr, 4), new4, "the device's bytes, not a hole");
    assert_eq!(page_of(ptr, 5), vec![0u8; PAGE_SIZE], "discarded: zeros");

    // Once the writer let go the same page is taken as usual: the fence only waits.
    let (shared, _, _) = share(&c, BatchId(3), vec![(Gfn(1), FrameId(0))]);
    assert!(shared.is_empty(), "page 1 now differs from the frame");
    write(ptr, 3, &old(1));
    let (shared, _, _) = share(&c, BatchId(4), vec![(Gfn(3), FrameId(0))]);
    assert_eq!(shared, vec![Gfn(3)]);
    assert_eq!(page_of(ptr, 3), old(1));
}

/// QEMU's own direct reads into guest RAM (`cache.direct=on`, `aio=threads`: `pread` and
/// `preadv` from its worker threads, the data landing in pinned pages before the call
/// returns) hold the fence over their buffers for the call: the agent's `pread` and
/// `preadv`, which win over libc's in QEMU and in this binary. Held here while the
/// read's copy waits for its destination (a page of this process whose fault the test
/// answers late). Fails if the interposed calls stop holding the fence.
#[test]
fn qemu_reads_into_guest_ram_hold_the_fence_for_their_call() {
    let fence = memfold_agent::fence::write_fence().expect("the fence is made");
    // The calls this binary makes are the agent's.
    let ours = memfold_agent::fence::pread as *const () as usize;
    // SAFETY: dlsym with a NUL-terminated name.
    let found = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"pread".as_ptr()) } as usize;
    assert_eq!(found, ours, "pread is the agent's");
    let mut file = tempfile::tempfile().unwrap();
    std::io::Write::write_all(&mut file, &[9u8; 2 * PAGE_SIZE]).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
    // SAFETY: as above.
    let chk = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"__pread_chk".as_ptr()) } as usize;
    assert_eq!(
        chk,
        memfold_agent::fence::__pread_chk as *const () as usize,
        "the fortified pread is the agent's"
    );
    for call in ["pread", "preadv", "__pread_chk"] {
        let held = HeldPage::new().unwrap();
        let dst = held.addr();
        assert!(!fence.busy(dst));
        let reader = std::thread::spawn(move || match call {
            "preadv" => {
                let iov = libc::iovec {
                    iov_base: dst as *mut libc::c_void,
                    iov_len: PAGE_SIZE,
                };
                // SAFETY: one iovec over the registered page; the file is open.
                unsafe { libc::preadv(fd, &iov, 1, 0) }
            }
            "pread" => {
                // SAFETY: the registered page, one page long; the file is open.
                unsafe { libc::pread(fd, dst as *mut libc::c_void, PAGE_SIZE, 0) }
            }
            _ => {
                // SAFETY: as pread, the buffer's length given.
                unsafe {
                    memfold_agent::fence::__pread_chk(
                        fd,
                        dst as *mut libc::c_void,
                        PAGE_SIZE,
                        0,
                        PAGE_SIZE,
                    )
                }
            }
        });
        assert!(
            held.wait_for_access(Duration::from_secs(10)).unwrap(),
            "the read never faulted"
        );
        assert!(fence.busy(dst), "held while the read's copy waits ({call})");
        held.release(&[0u8; PAGE_SIZE]).unwrap();
        assert_eq!(reader.join().unwrap(), PAGE_SIZE as isize);
        assert!(!fence.busy(dst), "let go when the call returns");
    }
}
