//! Hot-plugged RAM is found whichever way QEMU maps it. The watcher reads
//! `/proc/self/maps` at the first period after a QEMU thread mapped a file shared with
//! libc's `mmap` (interposed by the agent), and at least every `WATCH_BACKSTOP` (8 s)
//! otherwise (`regions.rs`). Here the "QEMU" maps one new backend with a raw system call
//! (the interposer does not see it: found by the backstop look), then, right after that
//! look, another with `mmap` (found at the next period, 2 s, long before the next
//! backstop look).
//!
//! Seen failing with the interposer's count disabled (`note_shared_map` not called): the
//! second region appeared 8 s after its mapping, not within 5 s.
//!
//! One test only: the agent, run in this process, takes every QEMU-named memfd of it.

mod common;

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use memfold_codecs::PAGE_SIZE;
use memfold_sys::memfd;
use memfold_wire::{Conn, Listener, ToDaemon};

/// Longest wait for an agent to attach: past two backstop looks.
const ATTACH: Duration = Duration::from_secs(20);

const PAGES: usize = 16;

/// A memfd of `PAGES` pages named as QEMU names its memory backends, and its size.
fn backend() -> (OwnedFd, usize) {
    let fd = memfd::create("memory-backend-memfd").unwrap();
    memfd::set_len(fd.as_fd(), (PAGES * PAGE_SIZE) as u64).unwrap();
    (fd, PAGES * PAGE_SIZE)
}

/// Accepts every agent connecting at `listener`, sending each connection and the name
/// its hello gives.
fn accept_all(listener: Listener) -> mpsc::Receiver<(Conn, String)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        while let Ok(c) = listener.accept() {
            c.set_recv_timeout(Duration::from_millis(200)).unwrap();
            let name = common::next(&c, |m| match m {
                ToDaemon::AgentHello { name, .. } => Some(name.clone()),
                _ => None,
            });
            if tx.send((c, name)).is_err() {
                return;
            }
        }
    });
    rx
}

#[test]
fn hot_plugged_ram_is_found_by_the_interposer_soon_and_by_the_backstop_anyway() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("d.sock");
    let (_fd0, _ptr0) = common::region(PAGES);
    let agents = accept_all(common::start_agent(Path::new(&socket)));
    let (c0, name0) = agents.recv_timeout(ATTACH).unwrap();
    assert_eq!(name0, "g");
    let pool = memfd::create("fake-pool").unwrap();
    memfd::set_len(pool.as_fd(), PAGE_SIZE as u64).unwrap();
    let store = memfd::create("fake-store").unwrap();
    common::welcome(&c0, &pool, &store);

    // Past the watcher's first look (one period after it started, before the first
    // region's hello).
    std::thread::sleep(Duration::from_secs(3));
    // Mapped with a raw system call: no interposer sees it; the backstop look finds it.
    let (fd1, len) = backend();
    // SAFETY: a new shared mapping of a memfd this test owns, at an address the kernel
    // picks; never unmapped; never touched.
    let p1 = unsafe {
        libc::syscall(
            libc::SYS_mmap,
            0usize,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd1.as_raw_fd(),
            0usize,
        )
    };
    assert_ne!(p1 as *mut libc::c_void, libc::MAP_FAILED);
    let (_c1, name1) = agents.recv_timeout(ATTACH).unwrap();
    assert_eq!(name1, "g/ram1");

    // Mapped with libc's `mmap` right after that look: found at the next period.
    let mapped = Instant::now();
    let (_fd2, _p2) = common::region(PAGES);
    let (_c2, name2) = agents.recv_timeout(ATTACH).unwrap();
    assert_eq!(name2, "g/ram2");
    let took = mapped.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "a region mapped with mmap was found after {took:?}: the interposer's count did not start a look"
    );
}
