//! A region hot-unplugged (QEMU's `object_del`: `munmap` of guest RAM) whose address QEMU
//! reuses at once (its heap, a thread's stack, a new DIMM) gets nothing of the agent's
//! mapped over it. The watcher sees an unplug only 2–10 s later; a request meanwhile (here
//! a take-back of a shared page: a CoW break, `mmap(MAP_FIXED)` of guest RAM's memfd at
//! `base + gfn * 4096`) would overwrite what QEMU put there. The agent interposes QEMU's
//! `munmap`, marking the region gone under its gate before the unmap (`unplug.rs`): the
//! request is refused or never carried out, the agent detaches (`RegionUnmapped`), and the
//! new mapping keeps its bytes.
//!
//! Seen failing with the interposer's marking disabled: the take-back was done and page 3
//! of the new mapping read guest RAM's bytes instead of 0xAA.
//!
//! One test only: the agent, run in this process, takes every QEMU-named memfd of it.

mod common;

use std::time::{Duration, Instant};

use common::{shared_page_by_page, text};
use memfold_codecs::PAGE_SIZE;
use memfold_wire::{BatchId, Gfn, ToAgent, ToDaemon};

const PAGES: usize = 8;

/// The shared page taken back after the unplug.
const TAKEN: u32 = 3;

#[test]
fn nothing_is_mapped_over_an_address_reused_after_an_unplug() {
    let dir = tempfile::tempdir().unwrap();
    let (fd, ptr, c, _pool, _store) = shared_page_by_page(dir.path(), PAGES, text);
    let len = PAGES * PAGE_SIZE;

    // QEMU unplugs the region (this thread is not the agent's) and maps something else
    // at its address at once.
    drop(fd);
    // SAFETY: the region's mapping, made by `shared_page_by_page`; nothing touches it
    // through a reference.
    assert_eq!(unsafe { libc::munmap(ptr.cast(), len) }, 0);
    // SAFETY: a new private mapping at an address nothing is mapped at (NOREPLACE).
    let reused = unsafe {
        libc::mmap(
            ptr.cast(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    assert_eq!(reused, ptr.cast(), "the address could not be reused");
    // SAFETY: the mapping just made, `len` bytes.
    unsafe { std::ptr::write_bytes(ptr, 0xAA, len) };

    // memfoldd, not yet told, asks for the shared page back.
    let _ = c.send(
        &ToAgent::TakeBack {
            batch: BatchId(1),
            gfns: vec![Gfn(TAKEN)],
        },
        &[],
    );
    c.set_recv_timeout(Duration::from_millis(100)).unwrap();
    let t = Instant::now();
    let mut answered = false;
    let mut unmapped = false;
    while !unmapped {
        assert!(t.elapsed() < Duration::from_secs(10), "no RegionUnmapped");
        match c.recv::<ToDaemon>() {
            Ok(Some((ToDaemon::TakeBackDone { taken, refused, .. }, _))) => {
                answered = true;
                untouched(ptr, len);
                assert_eq!(refused, [Gfn(TAKEN)], "taken back: {taken:?}");
            }
            Ok(Some((ToDaemon::RegionUnmapped, _))) => unmapped = true,
            Ok(Some(_)) | Err(_) => {}
            Ok(None) => panic!("the connection ended without a RegionUnmapped"),
        }
        // Checked as soon as the agent answers, whatever it says next.
        if answered || unmapped {
            untouched(ptr, len);
        }
    }
}

/// Asserts every byte of the `len` bytes at `ptr` is still 0xAA.
fn untouched(ptr: *mut u8, len: usize) {
    for i in 0..len {
        // SAFETY: inside the new mapping.
        let b = unsafe { std::ptr::read_volatile(ptr.add(i)) };
        assert_eq!(
            b,
            0xAA,
            "byte {} of page {} of the reused address was written",
            i % PAGE_SIZE,
            i / PAGE_SIZE
        );
    }
}
