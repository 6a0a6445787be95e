//! A memfoldd stopped or stalled, its listen backlog full, does not hold the guest: the
//! agent connects on the thread that serves its guest's faults, so a connect(2) that
//! waits for a place in the queue would stop the guest at its next fault, for as long
//! as memfoldd stays stalled. The agent's connect gives up at once and is tried again
//! later; faults are served meanwhile.
//!
//! This test binary plays QEMU (a shared `memory-backend-memfd` memfd mapped) and the
//! stalled memfoldd (a listener that never accepts). One test only: the agent, run in
//! this process, takes every such memfd of the process.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::{page_of, region, spawn_agent, write};
use memfold_agent::ClockRBits;
use memfold_codecs::PAGE_SIZE;
use memfold_wire::{Conn, Listener};

const PAGES: usize = 16;

#[test]
fn a_stalled_memfoldd_with_a_full_backlog_does_not_stop_the_guest() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("memfoldd.sock");
    let _stalled = Listener::bind(&socket).unwrap();
    // Fill its queue: connections nobody accepts, until the kernel refuses one.
    let mut queued = Vec::new();
    while let Ok(c) = Conn::connect_at_once(&socket) {
        queued.push(c);
        assert!(queued.len() < 10_000, "the backlog never filled");
    }
    let (_fd, ptr) = region(PAGES);
    spawn_agent(&socket, ClockRBits::Userfault);
    // Time to register the region and try its first attach (once a second after).
    std::thread::sleep(Duration::from_millis(1500));
    let addr = ptr as usize;
    let (done, touched) = mpsc::channel();
    std::thread::spawn(move || {
        let ptr = addr as *mut u8;
        // Pages never touched: each a missing fault the agent must serve.
        for g in 0..PAGES {
            write(ptr, g, &[g as u8 + 1; 64]);
        }
        let ok = (0..PAGES).all(|g| page_of(ptr, g)[..64] == [g as u8 + 1; 64]);
        let _ = done.send(ok);
    });
    let ok = touched
        .recv_timeout(Duration::from_secs(10))
        .expect("the guest's faults were not served: the agent waits in connect(2)");
    assert!(ok, "a page read other bytes than were written");
    assert!(page_of(ptr, 0)[64..] == [0u8; PAGE_SIZE - 64]);
}
