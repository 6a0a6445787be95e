//! Leaving a pool memfoldd will not adopt (`ToAgent::LeavePool`; never-share, Satori §4.3):
//! a guest shared onto a pool under one memfoldd re-attaches to one that keeps it alone,
//! while other QEMUs still hold that pool. Its agent copies every page off the pool's
//! frames — a run shared in one request and pages shared one by one — turns its
//! reclaimed zero page into a plain hole, lets the pool go and says hello again at once
//! with no pool. Afterwards every page reads as written, no mapping of the old pool is
//! left in the process, and a write to a page that was on a frame reaches the guest's own
//! RAM, not the pool (another process reading the pool never sees it, and it is no CoW
//! break), and the zero page's next touch is no refill (the new memfoldd was told of
//! no reclaimed page).
//!
//! This test binary plays QEMU (one `memory-backend-memfd` mapped) and both memfoldds.
//! One test only: the agent, run in this process, takes every such memfd of the process.

mod common;

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use common::{next, page_of, region, share, start_agent, text, welcome, write};
use memfold_codecs::PAGE_SIZE;
use memfold_sys::memfd;
use memfold_wire::{BatchId, Conn, FrameId, Gfn, Listener, ToAgent, ToDaemon};

/// Guest RAM, pages.
const PAGES: usize = 16;
/// Pages 0–5 shared in one request onto frames 0–5 (one mapping).
const RUN: std::ops::Range<usize> = 0..6;
/// Pages 8–11 shared one by one onto frames 8–11.
const SINGLES: std::ops::Range<usize> = 8..12;
/// A zero page, reclaimed.
const ZERO: usize = 13;

/// The next hello on `listener`: the connection and the descriptors it brought; panics
/// after 20 s (an agent that backed off instead of attaching again would come after 30).
fn hello(listener: &Arc<Listener>) -> (Conn, Vec<OwnedFd>) {
    let (tx, rx) = mpsc::channel();
    let l = listener.clone();
    std::thread::spawn(move || {
        let c = l.accept().unwrap();
        c.set_recv_timeout(Duration::from_millis(200)).unwrap();
        for _ in 0..50 {
            if let Ok(Some((ToDaemon::AgentHello { .. }, fds))) = c.recv::<ToDaemon>() {
                let _ = tx.send((c, fds));
                return;
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(20)).expect("a hello")
}

fn want(g: usize) -> Vec<u8> {
    if g == ZERO {
        vec![0u8; PAGE_SIZE]
    } else {
        text(g)
    }
}

#[test]
fn a_guest_told_to_leave_its_pool_copies_its_pages_off_it_and_attaches_without() {
    let dir = tempfile::tempdir().unwrap();
    let (_fd, ptr) = region(PAGES);
    for g in 0..PAGES {
        write(ptr, g, &want(g));
    }
    let listener = Arc::new(start_agent(&dir.path().join("memfoldd.sock")));
    let pool = memfd::create("fake-pool").unwrap();
    memfd::set_len(pool.as_fd(), (PAGES * PAGE_SIZE) as u64).unwrap();
    for g in 0..PAGES {
        memfd::pwrite_all(pool.as_fd(), &text(g), (g * PAGE_SIZE) as u64).unwrap();
    }
    let pool_ino = rustix::fs::fstat(&pool).unwrap().st_ino;
    let store = memfd::create("fake-store").unwrap();

    // The first memfoldd: shares, reclaims.
    let (c, _) = hello(&listener);
    welcome(&c, &pool, &store);
    let run: Vec<(Gfn, FrameId)> = RUN.map(|g| (Gfn(g as u32), FrameId(g as u32))).collect();
    assert_eq!(share(&c, BatchId(1), run).0.len(), RUN.len());
    for g in SINGLES {
        let pair = vec![(Gfn(g as u32), FrameId(g as u32))];
        assert_eq!(share(&c, BatchId(10 + g as u64), pair).0.len(), 1);
    }
    c.send(
        &ToAgent::ReclaimZero {
            batch: BatchId(100),
            gfns: vec![Gfn(ZERO as u32)],
        },
        &[],
    )
    .unwrap();
    let reclaimed = next(&c, |m| match m {
        ToDaemon::ReclaimDone {
            batch, reclaimed, ..
        } if *batch == BatchId(100) => Some(reclaimed.clone()),
        _ => None,
    });
    assert_eq!(reclaimed, vec![Gfn(ZERO as u32)]);
    assert!(
        memfold_sys::testing::mappings_of_inode(pool_ino) > 0,
        "nothing mapped from the pool"
    );

    // It goes; the next one keeps the guest alone and will not adopt the pool.
    drop(c);
    let (c, fds) = hello(&listener);
    assert_eq!(fds.len(), 3, "the re-attach brings RAM, pool and list");
    c.send(
        &ToAgent::LeavePool {
            message: "kept alone, and other processes hold the pool".into(),
        },
        &[],
    )
    .unwrap();
    drop(c);

    // At once, a hello with guest RAM alone.
    let (c, fds) = hello(&listener);
    assert_eq!(fds.len(), 1, "the hello after leaving brings no pool");
    // Welcomed with a pool of its own (before the guest touches a page: the agent waits
    // for the welcome on the thread that serves its faults).
    let own = memfd::create("fake-pool-2").unwrap();
    memfd::set_len(own.as_fd(), PAGE_SIZE as u64).unwrap();
    welcome(&c, &own, &store);
    assert_eq!(
        memfold_sys::testing::mappings_of_inode(pool_ino),
        0,
        "the old pool is still mapped after leaving it"
    );
    for g in 0..PAGES {
        assert!(page_of(ptr, g) == want(g), "page {g} differs after leaving");
    }

    // Its pages are its own RAM's.
    for g in [RUN.start, SINGLES.start] {
        write(ptr, g, &vec![0xEE; PAGE_SIZE]);
        assert!(page_of(ptr, g) == vec![0xEE; PAGE_SIZE]);
        let mut frame = vec![0u8; PAGE_SIZE];
        memfd::pread_exact(pool.as_fd(), &mut frame, (g * PAGE_SIZE) as u64).unwrap();
        assert!(
            frame == text(g),
            "the write to page {g} reached the old pool"
        );
    }
    c.set_recv_timeout(Duration::from_millis(100)).unwrap();
    for _ in 0..15 {
        match c.recv::<ToDaemon>() {
            Ok(Some((ToDaemon::CowBroken { breaks }, _))) => {
                panic!("a page off the old pool written as a CoW break: {breaks:?}")
            }
            // The new memfoldd was told of no reclaimed page (no list): a refill would
            // name a page it books as private.
            Ok(Some((ToDaemon::Refilled { gfns }, _))) => {
                panic!("a page reported refilled to a memfoldd that reclaimed none: {gfns:?}")
            }
            _ => {}
        }
    }
}
