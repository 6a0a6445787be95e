//! A page-out the agent cannot carry out is answered, not a dropped connection
//! (`Agent::page_out`): paging out is an offer memfoldd makes, so a failure refuses the
//! pages asked, keeps the connection (a drop costs a re-attach that lists every page)
//! and changes no page's bytes. The failure here is the agent's window onto guest RAM
//! not being mapped: the process's address space is capped just above what it uses, as
//! a host out of memory would make `mmap` fail. Seen failing with the error raised as
//! before (the agent dropped the connection: "no answer").
//!
//! Alone in its binary: the cap is the whole process's.

mod common;

use common::{agent_with_pool_rbits, clock_scan, page_of, page_out, region, write};
use memfold_agent::ClockRBits;
use memfold_codecs::PAGE_SIZE;
use memfold_wire::Gfn;

/// Guest RAM's pages: 64 MiB, so that the window (as large) cannot fit under the cap.
const PAGES: usize = 16 << 10;
/// Room the cap leaves above what the process maps (bytes).
const ROOM: u64 = 16 << 20;

/// Bytes of page `g`.
fn bytes(g: usize) -> Vec<u8> {
    (0..PAGE_SIZE)
        .map(|i| b"not paged out "[(i + g) % 14] ^ g as u8)
        .collect()
}

/// This process's virtual size (bytes), from `/proc/self/status`.
fn vm_size() -> u64 {
    let size = memfold_sys::proc::status_bytes(std::process::id(), "VmSize:");
    assert!(size > 0, "VmSize in /proc/self/status");
    size
}

/// The address space capped; lifted when dropped (also when the test fails under it:
/// a panic's backtrace maps files too).
struct Cap(libc::rlimit);

impl Drop for Cap {
    fn drop(&mut self) {
        // SAFETY: setrlimit reads the struct it is handed (the limits as they were).
        unsafe { libc::setrlimit(libc::RLIMIT_AS, &self.0) };
    }
}

/// Sets the soft limit on the address space to `cur` bytes, the hard one as it was.
fn cap_address_space(cur: libc::rlim_t) -> Cap {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is handed.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut old) }, 0);
    let new = libc::rlimit {
        rlim_cur: cur.min(old.rlim_max),
        rlim_max: old.rlim_max,
    };
    // SAFETY: setrlimit reads the struct it is handed.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &new) }, 0);
    Cap(old)
}

#[test]
fn a_page_out_that_fails_is_refused_and_the_connection_kept() {
    let dir = tempfile::tempdir().unwrap();
    let (_fd, ptr) = region(PAGES);
    for g in 0..4 {
        write(ptr, g, &bytes(g));
    }
    let (c, _pool, _store) =
        agent_with_pool_rbits(&dir.path().join("memfoldd.sock"), &[], ClockRBits::Pagemap);
    // Attached and serving: pages 0–3 armed (their PTEs dropped).
    clock_scan(&c, 1, 8, 0xf, 0);
    let cap = cap_address_space(vm_size() + ROOM);
    let (paged, resident, refused) = page_out(&c, 2, &[0, 1, 2, 3]);
    drop(cap);
    let ids = |v: &[Gfn]| v.iter().map(|g| g.0).collect::<Vec<u32>>();
    assert_eq!(
        (ids(&paged), ids(&resident), ids(&refused)),
        (vec![], vec![], vec![0, 1, 2, 3]),
        "no window: every page refused"
    );
    // The same connection answers the next page-out, whose window is made now (the
    // pages leave RAM or, with no swap, stay: each is answered one way).
    let (paged, resident, refused) = page_out(&c, 3, &[0, 1, 2, 3]);
    assert!(refused.is_empty(), "refused {refused:?}");
    assert_eq!(paged.len() + resident.len(), 4);
    for g in 0..4 {
        assert_eq!(page_of(ptr, g), bytes(g), "page {g}");
    }
}
