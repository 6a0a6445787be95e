//! An agent that gets anything but a welcome to its hello waits before it tries again:
//! a memfoldd that cannot read its hello (another protocol version) closes the
//! connection with no answer, and an agent that tried again every second sent it a hello
//! (and, re-attaching, its whole list) every second for good.
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
fn a_hello_answered_by_a_closed_connection_is_not_sent_again_at_once() {
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
    // Without the back-off: a hello each second, 4 or 5 here.
    std::thread::sleep(Duration::from_millis(4500));
    assert_eq!(
        hellos.load(Ordering::SeqCst),
        1,
        "the agent tried again without waiting"
    );
}
