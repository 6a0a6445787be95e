//! memfoldd out of descriptors while a guest attaches: that guest is refused, and memfoldd
//! goes on serving (a peer can exhaust a process's descriptors by holding connections;
//! memfoldd's backings for a new guest — its store, swap file, a new domain's pool, their
//! duplicates — then fail). Seen failing before the attach turned those failures into a
//! refusal: memfoldd's main loop ended and it answered no one.
//!
//! A binary of its own: it lowers the process's descriptor limit, which memfoldd (a
//! thread here) shares.

mod common;

use std::os::fd::AsFd;
use std::time::Duration;

use memfold_live::query_stats;
use memfold_sys::memfd;
use memfold_wire::{Conn, ToAgent, ToDaemon, PROTOCOL_VERSION};

const PAGES: u64 = 64;

/// The lowest descriptor number not in use (the next one `open` would give).
fn next_fd() -> u64 {
    let fd = memfd::create("probe").unwrap();
    std::os::fd::AsRawFd::as_raw_fd(&fd) as u64
}

#[test]
fn a_guest_attaching_when_memfoldd_has_no_descriptors_left_is_refused_and_memfoldd_goes_on() {
    let (old_soft, old_hard) = common::nofile();
    let dir = tempfile::tempdir().unwrap();
    let socket = common::start_memfoldd(dir.path(), common::fast_engine());
    let mut refused_for_backings = 0;
    let mut welcomed = 0;
    // One RAM memfd throughout: each attach after the first is the re-attach of the same
    // QEMU (this process) and RAM, as memfoldd requires.
    let ram = memfd::create("guest-ram").unwrap();
    memfd::set_len(ram.as_fd(), PAGES * 4096).unwrap();
    for k in 0..12u64 {
        let c = Conn::connect(&socket).unwrap();
        c.set_recv_timeout(Duration::from_secs(2)).unwrap();
        let hello = ToDaemon::AgentHello {
            version: PROTOCOL_VERSION,
            name: "g".into(),
            pid: std::process::id(),
            ram_bytes: PAGES * 4096,
            shared: 0,
            opted_out: false,
        };
        // From here memfoldd has `k` descriptors to take (its accept, the RAM it
        // receives, then its backings), so each k fails a later step.
        common::set_nofile(next_fd() + k, old_hard);
        c.send(&hello, &[ram.as_fd()]).unwrap();
        // The answer waited for under the limit, read above it: a welcome brings
        // descriptors this process must have room for.
        let mut p = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&c),
            events: libc::POLLIN,
            revents: 0,
        };
        // Long enough for a loaded machine (an attach refused for its backings takes
        // ms here); a hello memfoldd could not accept stays unanswered the whole wait.
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, 3000) };
        common::set_nofile(old_soft, old_hard);
        let reply = c.recv::<ToAgent>();
        match reply {
            Ok(Some((ToAgent::Welcome { .. }, _))) => welcomed += 1,
            Ok(Some((ToAgent::Refused { message }, _)))
                if message.contains("could not make its backings") =>
            {
                refused_for_backings += 1
            }
            // Refused before a word: no descriptor to accept it, or to receive its RAM.
            _ => {}
        }
        let stats = query_stats(&socket);
        assert!(
            stats.is_ok(),
            "k = {k}: memfoldd answers no more after a guest's attach ran out of descriptors"
        );
    }
    assert!(
        refused_for_backings > 0,
        "no attach failed making its backings: the test did not reach the path it guards"
    );
    assert!(welcomed > 0, "with enough descriptors a guest is welcomed");
}
