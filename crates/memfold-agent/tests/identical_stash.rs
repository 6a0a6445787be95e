//! Pages stashed as the identical patch (memfoldd's share without a mapping: the empty
//! run-diff patch against a pool frame, in the store), which the agent keeps as the frame
//! alone, with no record and no checksum (issue 19). The agent still decodes and checks
//! each such stash against the request's checksum and the page's bytes before it punches
//! the page; a page so kept reads back as its frame's bytes, a discard reports it stashed,
//! a move to the swap file is checked as any other, and before a re-attach it is written
//! back into guest RAM.
//!
//! This test binary plays QEMU (one `memory-backend-memfd` mapped) and memfoldd. One test
//! only: the agent, run in this process, takes every such memfd of the process.

mod common;

use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use common::{next, page_of, region, start_agent, write};
use memfold_codecs::{page_checksum, Page, PatchCodec, PAGE_SIZE};
use memfold_sys::memfd;
use memfold_wire::{
    BatchId, Blob, BlobHome, Conn, Discarded, FrameId, Gfn, Listener, StashPage, ToAgent, ToDaemon,
    PROTOCOL_VERSION,
};

/// Guest RAM, pages.
const PAGES: usize = 16;

/// Page `g` as the "guest" first writes it: no byte zero, no two pages alike.
fn text(g: usize) -> Page {
    let mut p = [0u8; PAGE_SIZE];
    for (i, b) in p.iter_mut().enumerate() {
        *b = ((g * 131 + i * 7) % 251) as u8 + 1;
    }
    p
}

/// Page `g` as the identical patch against `frame` (at a store offset that is never read:
/// the patch is empty), with `checksum`.
fn identical(g: usize, frame: u32, checksum: u64) -> StashPage {
    StashPage {
        gfn: Gfn(g as u32),
        blob: Blob::Patch {
            codec: PatchCodec::RunDiff,
            reference: FrameId(frame),
        },
        home: BlobHome::Store,
        offset: 3 * PAGE_SIZE as u64,
        len: 0,
        moving: false,
        checksum,
    }
}

/// (stashed, changed, refused) of stash request `batch`.
fn stash(c: &Conn, batch: u64, pages: Vec<StashPage>) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    c.send(
        &ToAgent::Stash {
            batch: BatchId(batch),
            pages,
        },
        &[],
    )
    .unwrap();
    let ids = |v: &[Gfn]| v.iter().map(|g| g.0).collect::<Vec<u32>>();
    next(c, |m| match m {
        ToDaemon::StashDone {
            batch: b,
            stashed,
            changed,
            refused,
        } if *b == BatchId(batch) => Some((ids(stashed), ids(changed), ids(refused))),
        _ => None,
    })
}

/// Accepts the agent's attach on `listener` and welcomes it with `fds` (pool, store,
/// swap file); returns the connection.
fn welcome(listener: &Listener, fds: &[&OwnedFd]) -> Conn {
    let c = listener.accept().unwrap();
    c.set_recv_timeout(Duration::from_millis(200)).unwrap();
    next(&c, |m| {
        matches!(m, ToDaemon::AgentHello { .. }).then_some(())
    });
    let fds: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
    c.send(
        &ToAgent::Welcome {
            version: PROTOCOL_VERSION,
        },
        &fds,
    )
    .unwrap();
    c
}

/// Asserts that page bytes `got` are `want`, naming `what` (not the 4 KiB of each).
fn same(got: &[u8], want: &[u8], what: &str) {
    let first = got.iter().zip(want).position(|(a, b)| a != b);
    assert!(
        got.len() == want.len() && first.is_none(),
        "{what}: differs from byte {first:?}"
    );
}

/// Page `g` of guest RAM's memfd, read directly (a hole reads zeros; no fault).
fn in_memfd(fd: &OwnedFd, g: usize) -> Vec<u8> {
    let mut b = vec![0xffu8; PAGE_SIZE];
    memfd::pread_exact(fd.as_fd(), &mut b, (g * PAGE_SIZE) as u64).unwrap();
    b
}

#[test]
fn identical_stashes_are_checked_then_read_back_discarded_moved_and_written_back_as_their_frames() {
    let (fd, ptr) = region(PAGES);
    for g in 0..PAGES {
        write(ptr, g, &text(g));
    }
    let dir = tempfile::tempdir().unwrap();
    let listener = start_agent(&dir.path().join("memfoldd.sock"));
    // Frame k holds page k + 1's bytes.
    let pool = memfd::create("fake-pool").unwrap();
    memfd::set_len(pool.as_fd(), (8 * PAGE_SIZE) as u64).unwrap();
    for k in 0..8 {
        memfd::pwrite_all(pool.as_fd(), &text(k + 1), (k * PAGE_SIZE) as u64).unwrap();
    }
    let store = memfd::create("fake-store").unwrap();
    memfd::set_len(store.as_fd(), (4 * PAGE_SIZE) as u64).unwrap();
    let swap = memfd::create("fake-swap").unwrap();
    memfd::set_len(swap.as_fd(), (4 * PAGE_SIZE) as u64).unwrap();
    memfd::pwrite_all(store.as_fd(), &text(7), 1).unwrap();
    let c = welcome(&listener, &[&pool, &store, &swap]);

    // Page 2 written since memfoldd read it: its bytes are no longer frame 1's.
    write(ptr, 2, b"written since");
    let sum = |g: usize| page_checksum(&text(g));
    let (stashed, changed, refused) = stash(
        &c,
        1,
        vec![
            identical(1, 0, sum(1)),
            identical(2, 1, sum(2)),
            // The request's checksum is checked too: a wrong one is refused.
            identical(3, 2, sum(3) ^ 1),
            identical(4, 3, sum(4)),
            identical(5, 4, sum(5)),
            identical(6, 5, sum(6)),
            // A blob the stash table cannot keep (its offsets are 8-byte units): refused,
            // though it decodes to the page's bytes.
            StashPage {
                gfn: Gfn(7),
                blob: Blob::Raw,
                home: BlobHome::Store,
                offset: 1,
                len: PAGE_SIZE as u32,
                moving: false,
                checksum: sum(7),
            },
        ],
    );
    assert_eq!(stashed, vec![1, 4, 5, 6]);
    assert_eq!(changed, vec![2], "compared with the page's bytes");
    assert_eq!(
        refused,
        vec![3, 7],
        "checked against the request's checksum; unaligned"
    );
    same(&page_of(ptr, 7), &text(7), "page 7, refused");
    for g in [1, 4, 5, 6] {
        same(
            &in_memfd(&fd, g),
            &[0; PAGE_SIZE],
            &format!("page {g} punched"),
        );
    }
    let mut want2 = text(2);
    want2[..13].copy_from_slice(b"written since");
    same(&page_of(ptr, 2), &want2, "page 2, written");
    same(&page_of(ptr, 3), &text(3), "page 3, refused");

    // Read back as its frame's bytes (the store is never read for it).
    memfd::pwrite_all(store.as_fd(), &[0xee; 4 * PAGE_SIZE], 0).unwrap();
    same(&page_of(ptr, 1), &text(1), "page 1 decoded back");
    let back = next(&c, |m| match m {
        ToDaemon::Unstashed { gfns } => Some(gfns.clone()),
        _ => None,
    });
    assert_eq!(back, vec![Gfn(1)]);

    // QEMU discards page 4 (punch, then `MADV_DONTNEED`): reported as stashed, zeros.
    assert!(memfd::punch_hole(
        fd.as_fd(),
        4 * PAGE_SIZE as u64,
        PAGE_SIZE as u64
    ));
    // SAFETY: drops the PTE of page 4 of the test's own mapping, as QEMU's
    // ram_block_discard_range does after its punch.
    let rc = unsafe {
        libc::madvise(
            ptr.add(4 * PAGE_SIZE).cast(),
            PAGE_SIZE,
            libc::MADV_DONTNEED,
        )
    };
    assert_eq!(rc, 0);
    let discarded = next(&c, |m| match m {
        ToDaemon::Discarded { pages } => Some(pages.clone()),
        _ => None,
    });
    assert_eq!(discarded, vec![(Gfn(4), Discarded::Stashed)]);
    same(&page_of(ptr, 4), &[0; PAGE_SIZE], "page 4, discarded");

    // Page 5 moved to the swap file: a raw page that is not its frame's bytes (though
    // true to its own checksum) is refused as changed; its own bytes move.
    let raw = |k: usize, g: usize| StashPage {
        gfn: Gfn(5),
        blob: Blob::Raw,
        home: BlobHome::Swap,
        offset: (k * PAGE_SIZE) as u64,
        len: PAGE_SIZE as u32,
        moving: true,
        checksum: sum(g),
    };
    memfd::pwrite_all(swap.as_fd(), &text(9), 0).unwrap();
    memfd::pwrite_all(swap.as_fd(), &text(5), PAGE_SIZE as u64).unwrap();
    assert_eq!(stash(&c, 2, vec![raw(0, 9)]), (vec![], vec![5], vec![]));
    assert_eq!(stash(&c, 3, vec![raw(1, 5)]), (vec![5], vec![], vec![]));

    // memfoldd gone: before the re-attach, pages 5 (in the swap file) and 6 (identical)
    // are written back into guest RAM's memfd.
    same(&in_memfd(&fd, 6), &[0; PAGE_SIZE], "page 6, stashed");
    drop(c);
    let pool2 = memfd::create("fake-pool-2").unwrap();
    let store2 = memfd::create("fake-store-2").unwrap();
    let c = welcome(&listener, &[&pool2, &store2]);
    same(&in_memfd(&fd, 6), &text(6), "page 6 written back");
    same(&in_memfd(&fd, 5), &text(5), "page 5 written back");
    same(&page_of(ptr, 6), &text(6), "page 6");
    same(&page_of(ptr, 5), &text(5), "page 5");
    drop(c);
}
