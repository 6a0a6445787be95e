//! A read served from a pool frame (Satori §5.2, `ToAgent::Fill`): the block device writes
//! a nonce at the start of each page its read would fill, and the agent maps the frame
//! over each page that still begins with it, checked under write-protection. The
//! invariant kept here: **a fill never hides a byte written after the nonce** — a device
//! that gave up waiting and wrote the disk's bytes, or a guest that wrote the page after
//! that, keeps its bytes however late the fill arrives. And a write racing the fill
//! lands in a CoW copy of the frame, never in a page the guest no longer sees.
//!
//! This test binary plays QEMU and memfoldd (`common`). One test: the agent, run in this
//! process, takes every QEMU-named memfd of the process.

mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::{agent_with_pool, page_of, region, write};
use memfold_codecs::PAGE_SIZE;
use memfold_sys::memfd;
use memfold_wire::{BatchId, Conn, FrameId, Gfn, ToAgent, ToDaemon};

/// Guest RAM, pages.
const PAGES: usize = 16;

/// The nonce of the test's reads.
const NONCE: [u64; 2] = [0x6d65_6d66_6f6c_6421, 0x0123_4567_89ab_cdef];

/// The base block frame 0 holds: no byte zero, none equal to the nonce's start.
fn block(i: usize) -> u8 {
    (i % 199) as u8 + 40
}

fn nonce_bytes(n: [u64; 2]) -> Vec<u8> {
    [n[0].to_ne_bytes(), n[1].to_ne_bytes()].concat()
}

/// Asks the agent to fill `gfns` from frame 0 with `nonce`; returns (shared, changed).
fn fill(c: &Conn, batch: u64, gfns: &[usize], nonce: [u64; 2]) -> (Vec<Gfn>, Vec<Gfn>) {
    let batch = BatchId(batch);
    let pages = gfns.iter().map(|&g| (Gfn(g as u32), FrameId(0))).collect();
    c.send(
        &ToAgent::Fill {
            batch,
            pages,
            nonce,
        },
        &[],
    )
    .unwrap();
    let t = Instant::now();
    loop {
        assert!(t.elapsed() < Duration::from_secs(10), "no answer");
        if let Ok(Some((
            ToDaemon::ShareDone {
                batch: b,
                shared,
                changed,
                ..
            },
            _,
        ))) = c.recv::<ToDaemon>()
        {
            if b == batch {
                return (shared, changed);
            }
        }
    }
}

#[test]
fn a_fill_maps_the_frame_only_over_pages_that_still_hold_the_nonce() {
    let (_fd, ptr) = region(PAGES);
    // Every page starts as the guest's old data (a freed page-cache page).
    for g in 0..PAGES {
        write(ptr, g, &vec![g as u8 + 1; PAGE_SIZE]);
    }
    let dir = tempfile::tempdir().unwrap();
    let frame: Vec<u8> = (0..PAGE_SIZE).map(block).collect();
    let (c, pool, _store) = agent_with_pool(
        &dir.path().join("memfoldd.sock"),
        std::slice::from_ref(&frame),
    );
    let nonce = nonce_bytes(NONCE);

    // 1: the device wrote the nonce and waits: the frame is mapped over the page, which
    // now reads as the block without the disk.
    write(ptr, 1, &nonce);
    // 2: the device gave up waiting and wrote the disk's bytes (the block) over it.
    write(ptr, 2, &nonce);
    write(ptr, 2, &frame);
    // 3: another read's nonce.
    write(ptr, 3, &nonce_bytes([1, 2]));
    // 4: the device gave up, wrote the block, completed, and the guest then wrote the
    // page: the fill arriving now must not hide the guest's write.
    write(ptr, 4, &nonce);
    write(ptr, 4, &frame);
    let guest4 = vec![0xa5u8; PAGE_SIZE];
    write(ptr, 4, &guest4);
    // A zero nonce would match a never-written page: refused, nothing mapped.
    let (shared, changed) = fill(&c, 0, &[1], [0, 0]);
    assert!(shared.is_empty() && changed.is_empty());
    let (shared, changed) = fill(&c, 1, &[1, 2, 3, 4], NONCE);
    assert_eq!(shared, [Gfn(1)]);
    assert_eq!(changed, [Gfn(2), Gfn(3), Gfn(4)]);
    assert_eq!(page_of(ptr, 1), frame, "page 1 is the frame");
    assert_eq!(page_of(ptr, 2), frame, "page 2 as the device wrote it");
    let mut p3 = vec![4u8; PAGE_SIZE];
    p3[..16].copy_from_slice(&nonce_bytes([1, 2]));
    assert_eq!(page_of(ptr, 3), p3, "page 3 untouched");
    assert_eq!(
        page_of(ptr, 4),
        guest4,
        "the guest's write survives a late fill"
    );

    // The guest writes the filled page: a CoW break; the frame keeps the block.
    write(ptr, 1, b"guest");
    let mut p1 = frame.clone();
    p1[..5].copy_from_slice(b"guest");
    assert_eq!(page_of(ptr, 1), p1);
    let mut f = vec![0u8; PAGE_SIZE];
    memfd::pread_exact(pool.as_fd(), &mut f, 0).unwrap();
    assert_eq!(f, frame, "the frame is never written");

    // A write racing the fill (a device that gave up at this very moment writes the
    // block, then the guest writes the page): whichever comes first, the page ends as
    // the guest's bytes — a write after the write-protection waits for the mapping and
    // lands in a CoW copy of the frame.
    for round in 0..20u64 {
        let g = 5 + (round as usize % (PAGES - 5));
        write(ptr, g, &nonce);
        let p = ptr as usize;
        let frame2 = frame.clone();
        let racer = std::thread::spawn(move || {
            let ptr = p as *mut u8;
            std::thread::sleep(Duration::from_micros(round * 50));
            write(ptr, g, &frame2);
            let mut mine = vec![round as u8 + 100; PAGE_SIZE];
            mine[..8].copy_from_slice(&round.to_le_bytes());
            write(ptr, g, &mine);
            mine
        });
        let (shared, changed) = fill(&c, 100 + round, &[g], NONCE);
        assert_eq!(shared.len() + changed.len(), 1, "round {round}");
        let mine = racer.join().unwrap();
        assert_eq!(
            page_of(ptr, g),
            mine,
            "round {round}: the racing writes survive"
        );
    }
}
