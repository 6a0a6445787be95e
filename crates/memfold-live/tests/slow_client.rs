//! A client that sends requests and never reads the answers must not stall memfoldd for
//! anyone else (a tenant's QEMU may talk to the socket as a client). Before each client's
//! answers were sent by its connection's reader, the main thread sent them, each waiting
//! out the 2 s send timeout once the client's buffer was full: hundreds of queued
//! requests held every guest and every other client for minutes (seen failing: the
//! honest query did not come back within its limit).

mod common;

use std::time::{Duration, Instant};

use memfold_live::query_stats;
use memfold_wire::{Conn, ToDaemon, PROTOCOL_VERSION};

#[test]
fn a_client_that_never_reads_its_answers_stalls_no_one_else() {
    let dir = tempfile::tempdir().unwrap();
    let socket = common::start_memfoldd(dir.path(), common::fast_engine());
    let flood = Conn::connect(&socket).unwrap();
    flood
        .send(
            &ToDaemon::ClientHello {
                version: PROTOCOL_VERSION,
            },
            &[],
        )
        .unwrap();
    flood.set_send_timeout(Duration::from_millis(200)).unwrap();
    let mut sent = 0;
    while sent < 2000 && flood.send(&ToDaemon::Stats, &[]).is_ok() {
        sent += 1;
    }
    assert!(sent >= 100, "only {sent} requests went out");
    // Give the queue time to fill every buffer on the way.
    std::thread::sleep(Duration::from_millis(500));
    // Each honest query gets 10 s, against the minutes a stalled main thread would take
    // (a liveness bound, not a speed target).
    for _ in 0..3 {
        let (tx, rx) = std::sync::mpsc::channel();
        let at = socket.clone();
        std::thread::spawn(move || {
            let _ = tx.send(query_stats(&at).is_ok());
        });
        let t = Instant::now();
        let answered = rx.recv_timeout(Duration::from_secs(10));
        assert_eq!(
            answered,
            Ok(true),
            "an honest query behind {sent} unread requests: no answer after {:?}",
            t.elapsed()
        );
    }
    drop(flood);
}
