//! A page punched outside the agent between its minor fault and the agent's answer: the
//! guest reads a page the clock armed (its PTE dropped, the page in the memfd), and
//! before the agent serves the fault QEMU punches the page (a balloon's or virtio-mem's
//! discard; a punch raises no userfaultfd event). `UFFDIO_CONTINUE` then finds no page
//! to map (`EFAULT`); the agent retried the same fault for 30 s and failed closed, for a
//! fault it can serve: woken, the access faults again as missing, and reads the hole's
//! zeros, as it would without memfold.
//!
//! The window is made wide on purpose: the fake memfoldd closes its connection after the
//! arming, and holds its welcome when the agent re-attaches (the agent serves no fault
//! while it waits for the welcome, up to 2 s); the read and the punch happen then.
//!
//! Seen failing without the mend: the read had not returned after 5 s.
//!
//! One test only: the agent, run in this process, takes every QEMU-named memfd of it.

mod common;

use std::os::fd::AsFd;
use std::time::Duration;

use common::{accept_hello, clock_scan, page_of, region, start_agent, text, welcome, write};
use memfold_codecs::PAGE_SIZE;
use memfold_sys::memfd;
use rustix::fs::FallocateFlags;

const PAGES: usize = 8;
const PUNCHED: usize = 3;

#[test]
fn a_page_punched_between_its_minor_fault_and_its_answer_reads_zeros() {
    let (fd, ptr) = region(PAGES);
    for g in 0..PAGES {
        write(ptr, g, &text(g));
    }
    let dir = tempfile::tempdir().unwrap();
    let listener = start_agent(&dir.path().join("memfoldd.sock"));
    let pool = memfd::create("fake-pool").unwrap();
    memfd::set_len(pool.as_fd(), PAGE_SIZE as u64).unwrap();
    let store = memfd::create("fake-store").unwrap();
    let c = accept_hello(&listener);
    welcome(&c, &pool, &store);
    // Arm the page: its next access is a minor fault.
    clock_scan(&c, 1, PAGES as u32, 1 << PUNCHED, 0);

    // memfoldd goes; the agent re-attaches a second later, and its welcome is held.
    drop(c);
    let c = accept_hello(&listener);
    let at = ptr as usize;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(page_of(at as *mut u8, PUNCHED));
    });
    std::thread::sleep(Duration::from_millis(200));
    rustix::fs::fallocate(
        &fd,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        (PUNCHED * PAGE_SIZE) as u64,
        PAGE_SIZE as u64,
    )
    .unwrap();
    welcome(&c, &pool, &store);

    let got = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the read of the punched page had not returned after 5 s");
    assert!(got == vec![0u8; PAGE_SIZE], "the punched page reads zeros");
    for g in (0..PAGES).filter(|&g| g != PUNCHED) {
        assert!(page_of(ptr, g) == text(g), "page {g} differs");
    }
}
