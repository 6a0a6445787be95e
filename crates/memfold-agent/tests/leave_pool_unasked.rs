//! A `ToAgent::LeavePool` answering a hello that brought no pool is a refusal: the agent
//! has nothing to leave, and attaching again at once would send the same hello for as
//! long as memfoldd (or whatever listens at its socket) answers so — a loop on the
//! thread that serves the guest's faults. Here it must not say hello again within the
//! next seconds (it waits the refusal's back-off).
//!
//! One test only: the agent, run in this process, takes every QEMU-named memfd of it.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::{accept_hello, region, start_agent};
use memfold_wire::ToAgent;

#[test]
fn a_leave_pool_to_a_hello_without_one_is_a_refusal() {
    let dir = tempfile::tempdir().unwrap();
    let (_fd, _ptr) = region(8);
    let listener = start_agent(&dir.path().join("memfoldd.sock"));
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || loop {
        let c = accept_hello(&listener);
        let _ = c.send(
            &ToAgent::LeavePool {
                message: "leave a pool you do not have".into(),
            },
            &[],
        );
        if tx.send(()).is_err() {
            return;
        }
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("a first hello");
    assert!(
        rx.recv_timeout(Duration::from_secs(3)).is_err(),
        "a hello again at once after a LeavePool it could not follow"
    );
}
