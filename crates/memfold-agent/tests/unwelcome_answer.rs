//! An agent whose hello is answered by a closed connection tries again a second later,
//! a few times (a memfoldd stopping or restarting closes the hellos it queued, and its
//! successor should not wait 30 s for the guest), then waits before it tries again: a
//! memfoldd that cannot read its hello (another protocol version) closes every one, and
//! an agent that tried again every second sent it a hello (and, re-attaching, its whole
//! list) every second for good.
//!
//! This test binary plays QEMU (a shared `memory-backend-memfd` memfd mapped) and that
//! memfoldd (a listener that reads each hello and closes the connection). One test only:
//! the agent, run in this process, takes every such memfd of the process.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{region, spawn_agent};
use memfold_agent::ClockRBits;
use memfold_wire::{Listener, ToDaemon};

#[test]
fn closed_connections_are_tried_again_a_few_times_then_backed_off() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("memfoldd.sock");
    let listener = Listener::bind(&socket).unwrap();
    let hellos = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&hellos);
    std::thread::spawn(move || loop {
        let Ok(c) = listener.accept() else { return };
        if let Ok(Some((ToDaemon::AgentHello { .. }, _))) = c.recv::<ToDaemon>() {
            seen.fetch_add(1, Ordering::SeqCst);
        }
        // No answer: the connection closes.
    });
    let (_fd, _ptr) = region(16);
    spawn_agent(&socket, ClockRBits::Userfault);
    // A hello each second until the third close, then none for 30 s: without the
    // back-off 6 or 7 here, backing off at the first close 1.
    std::thread::sleep(Duration::from_millis(6500));
    assert_eq!(
        hellos.load(Ordering::SeqCst),
        3,
        "the agent's tries after closed connections"
    );
}
