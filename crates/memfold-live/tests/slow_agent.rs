//! An agent that stops reading must not stall memfoldd for the other guests: memfoldd's
//! messages to it queue for its connection's writer thread (`daemon/outbox.rs`). Before,
//! the main thread sent them and, once the agent's socket was full, waited out the 2 s
//! send timeout, every guest and client with it (seen failing: a statistics query behind
//! it took over 2 s).
//!
//! This test process plays a QEMU that attaches with a guest of many equal pages (so
//! memfoldd has shares to ask for at once) and a small receive buffer, and never reads;
//! a probe asks memfoldd for its statistics every 50 ms meanwhile, until memfoldd takes
//! the silent agent as gone (its writer's send timed out), which it must.

mod common;

use std::os::fd::{AsFd, AsRawFd};
use std::time::{Duration, Instant};

use memfold_core::{EngineConfig, Policy};
use memfold_live::query_stats;
use memfold_sys::memfd;
use memfold_wire::{Conn, ToAgent, ToDaemon, PROTOCOL_VERSION};

const PAGES: u64 = 16384;

#[test]
fn an_agent_that_stops_reading_stalls_no_one_else() {
    let dir = tempfile::tempdir().unwrap();
    let socket = common::start_memfoldd(
        dir.path(),
        EngineConfig {
            policy: Policy::sharing_only(),
            clock_interval_us: Some(50_000),
            ..common::fast_engine()
        },
    );
    let ram = memfd::create("silent-ram").unwrap();
    memfd::set_len(ram.as_fd(), PAGES * 4096).unwrap();
    let page: Vec<u8> = b"the same page "
        .iter()
        .copied()
        .cycle()
        .take(4096)
        .collect();
    for g in 0..PAGES {
        memfd::pwrite_all(ram.as_fd(), &page, g * 4096).unwrap();
    }
    let silent = Conn::connect(&socket).unwrap();
    let small: libc::c_int = 4096;
    // SAFETY: a valid option value for this socket.
    unsafe {
        libc::setsockopt(
            silent.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&small as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    let hello = ToDaemon::AgentHello {
        version: PROTOCOL_VERSION,
        name: "silent".into(),
        pid: std::process::id(),
        ram_bytes: PAGES * 4096,
        shared: 0,
        opted_out: false,
    };
    silent.send(&hello, &[ram.as_fd()]).unwrap();
    silent.set_recv_timeout(Duration::from_secs(5)).unwrap();
    let welcome = silent.recv::<ToAgent>().unwrap().expect("an answer").0;
    assert!(matches!(welcome, ToAgent::Welcome { .. }), "{welcome:?}");
    // From here it reads nothing.
    let mut worst = Duration::ZERO;
    let mut detached = false;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(8) {
        let asked = Instant::now();
        let stats = query_stats(&socket).unwrap();
        worst = worst.max(asked.elapsed());
        if stats.vms.iter().any(|v| v.name == "silent" && v.detached) {
            detached = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // A liveness bound, not a speed target: a blocked main thread took over 2 s.
    assert!(
        worst < Duration::from_millis(1500),
        "a query took {worst:?}"
    );
    // And the agent that does not read is taken as gone once a send waited out the 2 s
    // send timeout (a send that timed out once counted as sent: never detached).
    assert!(detached, "the silent agent was never detached");
    drop(silent);
}
