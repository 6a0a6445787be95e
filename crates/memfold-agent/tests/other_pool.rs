//! A re-attach welcomed with another pool than the one the guest's shared pages are on
//! is not taken: the agent's CoW breaks and decodes read frames at their offsets in the
//! pool it holds, so taking a new pool would give a page that breaks the new pool's bytes
//! at that offset, another guest's data. An honest memfoldd hands back the pool it
//! adopted (or refuses); this test plays one that does not (a socket taken over, a bug).
//!
//! Here page 0 is shared onto frame 0, memfoldd goes, the agent re-attaches and is
//! welcomed with a pool whose frame 0 holds other bytes; the guest then writes page 0:
//! it must read its own bytes around the write, and the agent stays detached.
//!
//! Seen failing without the check: page 0 read the other pool's bytes after the break.
//!
//! One test only: the agent, run in this process, takes every QEMU-named memfd of it.

mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::{accept_hello, page_of, region, share, start_agent, text, welcome, write};
use memfold_codecs::PAGE_SIZE;
use memfold_sys::memfd;
use memfold_wire::{BatchId, FrameId, Gfn, ToDaemon};

const PAGES: usize = 4;

#[test]
fn a_welcome_with_another_pool_than_the_shared_pages_one_is_not_taken() {
    let (_fd, ptr) = region(PAGES);
    for g in 0..PAGES {
        write(ptr, g, &text(g));
    }
    let dir = tempfile::tempdir().unwrap();
    let listener = start_agent(&dir.path().join("memfoldd.sock"));
    let pool_with = |bytes: &[u8]| {
        let p = memfd::create("fake-pool").unwrap();
        memfd::set_len(p.as_fd(), PAGE_SIZE as u64).unwrap();
        memfd::pwrite_all(p.as_fd(), bytes, 0).unwrap();
        p
    };
    let ours = pool_with(&text(0));
    let other = pool_with(&[0xEE; PAGE_SIZE]);
    let store = memfd::create("fake-store").unwrap();
    let c = accept_hello(&listener);
    welcome(&c, &ours, &store);
    let (shared, _, _) = share(&c, BatchId(1), vec![(Gfn(0), FrameId(0))]);
    assert_eq!(shared, [Gfn(0)]);

    // memfoldd goes; the one that answers the re-attach hands another pool.
    drop(c);
    let c = accept_hello(&listener);
    welcome(&c, &other, &store);
    std::thread::sleep(Duration::from_millis(300));

    write(ptr, 0, b"the guest's own");
    let mut want = text(0);
    want[..15].copy_from_slice(b"the guest's own");
    assert!(
        page_of(ptr, 0) == want,
        "page 0 is not its bytes after the break"
    );
    for g in 1..PAGES {
        assert!(page_of(ptr, g) == text(g), "page {g} differs");
    }
    // Not attached: no report of the break, nor statistics, on that connection.
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(1500) {
        match c.recv::<ToDaemon>() {
            Ok(Some((m, _))) => panic!("the agent attached with the other pool: {m:?}"),
            Ok(None) => break,
            Err(_) => {}
        }
    }
}
