//! Free-page discard (issue 17; PV §3.1), the agent's half: memfoldd watches pages
//! (`ToAgent::Watch`), asks the guest which are free, and discards those
//! (`ToAgent::DiscardFree`). The invariant the agent keeps: *a page is discarded only if
//! no write reached it since it was watched*. Here the "guest" writes one watched page
//! (and another the clock armed, so that its write is a minor fault) and reads another;
//! memfoldd then asks to discard them all, and a page it never
//! watched: the written and the unwatched page keep their bytes, the others read zeros
//! and are holes in the memfd. A share of a watched page ends its watch too (a new home),
//! and so does a zero-page reclaim's unprotect. A page on a frame is watched as it is
//! (protected by its share) and discarded off its frame without a copy; one written
//! after its watch is CoW-broken and kept.
//!
//! This test binary plays QEMU (one `memory-backend-memfd` mapped) and memfoldd. One test
//! only: the agent, run in this process, takes every such memfd of the process.

mod common;

use std::os::fd::AsFd;

use common::{agent_with_pool, next, page_of, region, share, watch, write};
use memfold_codecs::page_checksum;
use memfold_codecs::PAGE_SIZE;
use memfold_sys::memfd;
use memfold_wire::{BatchId, Blob, BlobHome, Conn, FrameId, Gfn, StashPage, ToAgent, ToDaemon};

/// Guest RAM, pages.
const PAGES: usize = 16;

/// Byte `i` of page `g` as the "guest" first writes it: never zero.
fn pattern(g: usize, i: usize) -> u8 {
    ((g * 131 + i * 7) % 251) as u8 + 1
}

/// (discarded, changed, refused).
fn discard(c: &Conn, batch: u64, gfns: &[u32]) -> (Vec<Gfn>, Vec<Gfn>, Vec<Gfn>) {
    c.send(
        &ToAgent::DiscardFree {
            batch: BatchId(batch),
            gfns: gfns.iter().map(|&g| Gfn(g)).collect(),
        },
        &[],
    )
    .unwrap();
    next(c, |m| match m {
        ToDaemon::DiscardDone {
            batch: b,
            discarded,
            changed,
            refused,
        } if *b == BatchId(batch) => Some((discarded.clone(), changed.clone(), refused.clone())),
        _ => None,
    })
}

fn gfns(g: &[u32]) -> Vec<Gfn> {
    g.iter().map(|&g| Gfn(g)).collect()
}

#[test]
fn only_pages_unwritten_since_their_watch_are_discarded() {
    let (fd, ptr) = region(PAGES);
    for g in 0..PAGES {
        let bytes: Vec<u8> = (0..PAGE_SIZE).map(|i| pattern(g, i)).collect();
        write(ptr, g, &bytes);
    }
    let dir = tempfile::tempdir().unwrap();
    // Pool frames holding pages 6, 10 and 11's bytes, for shares.
    let frames: Vec<Vec<u8>> = [6, 10, 11]
        .iter()
        .map(|&g| (0..PAGE_SIZE).map(|i| pattern(g, i)).collect())
        .collect();
    let (c, _pool, store) = agent_with_pool(&dir.path().join("memfoldd.sock"), &frames);

    // Page 8 armed by the clock first (write-protected and zapped: its next write is a
    // minor fault, not a write-protect fault).
    c.send(
        &ToAgent::ClockScan {
            batch: BatchId(10),
            first: Gfn(8),
            count: 1,
            arm: vec![1],
            wp_only: vec![],
            zap_shared: false,
        },
        &[],
    )
    .unwrap();
    next(&c, |m| {
        matches!(
            m,
            ToDaemon::ClockBits {
                batch: BatchId(10),
                ..
            }
        )
        .then_some(())
    });
    // Pages 0..9 watched; one past RAM refused.
    let (watched, refused) = watch(&c, 1, &[0, 1, 2, 3, 4, 5, 6, 7, 8, PAGES as u32]);
    assert_eq!(watched, gfns(&[0, 1, 2, 3, 4, 5, 6, 7, 8]));
    assert_eq!(refused, gfns(&[PAGES as u32]));

    // The guest writes page 2 (a write fault: the watch ends) and only reads page 3.
    write(ptr, 2, b"written after the watch");
    write(ptr, 8, b"a minor fault");
    let _ = page_of(ptr, 3);
    // Page 6 is shared (a new home ends its watch) and CoW-broken back by a write.
    let (shared, _, _) = share(&c, BatchId(2), vec![(Gfn(6), FrameId(0))]);
    assert_eq!(shared, gfns(&[6]));
    write(ptr, 6, b"broken");
    // Page 7 is zero-page-reclaim checked (not zero: left), and unprotected: its watch
    // ends, since a write would no longer fault.
    c.send(
        &ToAgent::ReclaimZero {
            batch: BatchId(3),
            gfns: gfns(&[7]),
        },
        &[],
    )
    .unwrap();
    let changed = next(&c, |m| match m {
        ToDaemon::ReclaimDone {
            batch: BatchId(3),
            changed,
            ..
        } => Some(changed.clone()),
        _ => None,
    });
    assert_eq!(changed, gfns(&[7]));

    // Discard all, and page 9, never watched.
    let (discarded, changed, refused) = discard(&c, 4, &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
    assert_eq!(discarded, gfns(&[0, 1, 3, 4, 5]), "watched, unwritten");
    assert_eq!(
        changed,
        gfns(&[2, 6, 7, 8, 9]),
        "written (a protection fault, a minor fault), re-homed, unprotected, unwatched"
    );
    assert!(refused.is_empty(), "{refused:?}");

    // The discarded pages are holes in the memfd and read as zeros.
    for g in [0usize, 1, 3, 4, 5] {
        let mut b = vec![0xffu8; PAGE_SIZE];
        memfd::pread_exact(fd.as_fd(), &mut b, (g * PAGE_SIZE) as u64).unwrap();
        assert!(b.iter().all(|&x| x == 0), "page {g} in the memfd");
        assert!(page_of(ptr, g).iter().all(|&x| x == 0), "page {g}");
    }
    // The others keep every byte the guest wrote.
    let mut want2: Vec<u8> = (0..PAGE_SIZE).map(|i| pattern(2, i)).collect();
    want2[..23].copy_from_slice(b"written after the watch");
    assert_eq!(page_of(ptr, 2), want2);
    let mut want6: Vec<u8> = (0..PAGE_SIZE).map(|i| pattern(6, i)).collect();
    want6[..6].copy_from_slice(b"broken");
    assert_eq!(page_of(ptr, 6), want6);
    let mut want8: Vec<u8> = (0..PAGE_SIZE).map(|i| pattern(8, i)).collect();
    want8[..13].copy_from_slice(b"a minor fault");
    assert_eq!(page_of(ptr, 8), want8);
    for g in [7usize, 9, 10] {
        let want: Vec<u8> = (0..PAGE_SIZE).map(|i| pattern(g, i)).collect();
        assert_eq!(page_of(ptr, g), want, "page {g}");
    }
    // A discarded page is the guest's again: written, it keeps what it is given.
    write(ptr, 4, b"reused");
    assert_eq!(&page_of(ptr, 4)[..6], b"reused");
    // A second discard of the same pages finds no watch: nothing is lost twice.
    let (discarded, changed, _) = discard(&c, 5, &[0, 4]);
    assert!(discarded.is_empty());
    assert_eq!(changed, gfns(&[0, 4]));
    assert_eq!(&page_of(ptr, 4)[..6], b"reused");

    // Shared pages (Satori §4.3's no-copy-on-write, per page): pages 10 and 11 on their
    // frames are watched (protected already), the guest writes page 11 (a CoW break: its
    // watch ends), and the discard drops page 10 from its frame to a hole, no copy made.
    let (shared, _, _) = share(
        &c,
        BatchId(6),
        vec![(Gfn(10), FrameId(1)), (Gfn(11), FrameId(2))],
    );
    assert_eq!(shared, gfns(&[10, 11]));
    let (watched, refused) = watch(&c, 7, &[10, 11]);
    assert_eq!((watched, refused), (gfns(&[10, 11]), vec![]));
    write(ptr, 11, b"written on the frame");
    // Written back to the frame's bytes and shared again: on its frame, but its watch
    // ended with the break, so it is not discarded (memfoldd may still think it free).
    let orig11: Vec<u8> = (0..PAGE_SIZE).map(|i| pattern(11, i)).collect();
    write(ptr, 11, &orig11);
    let (shared, _, _) = share(&c, BatchId(9), vec![(Gfn(11), FrameId(2))]);
    assert_eq!(shared, gfns(&[11]));
    let (discarded, changed, refused) = discard(&c, 8, &[10, 11]);
    assert_eq!(discarded, gfns(&[10]), "watched and unwritten on its frame");
    assert_eq!(
        changed,
        gfns(&[11]),
        "written after its watch, then shared again"
    );
    assert!(refused.is_empty(), "{refused:?}");
    assert!(
        page_of(ptr, 10).iter().all(|&x| x == 0),
        "page 10 reads zeros"
    );
    let mut b = vec![0xffu8; PAGE_SIZE];
    memfd::pread_exact(fd.as_fd(), &mut b, (10 * PAGE_SIZE) as u64).unwrap();
    assert!(b.iter().all(|&x| x == 0), "page 10 is a hole in the memfd");
    assert_eq!(page_of(ptr, 11), orig11);
    // Page 10 is guest RAM again (no longer the frame's): a write stays its own.
    write(ptr, 10, b"after");
    assert_eq!(&page_of(ptr, 10)[..5], b"after");
    assert!(page_of(ptr, 10)[5..].iter().all(|&x| x == 0));

    // Stashed pages: 12 and 13 kept as raw blobs in the store, watched; the guest reads
    // page 13 (decoded back: its watch ends) and the discard lets page 12's blob go.
    for (k, g) in [12usize, 13].into_iter().enumerate() {
        let page: Vec<u8> = (0..PAGE_SIZE).map(|i| pattern(g, i)).collect();
        memfd::pwrite_all(store.as_fd(), &page, (k * PAGE_SIZE) as u64).unwrap();
    }
    let stash = |g: usize, k: usize| StashPage {
        gfn: Gfn(g as u32),
        blob: Blob::Raw,
        home: BlobHome::Store,
        offset: (k * PAGE_SIZE) as u64,
        len: PAGE_SIZE as u32,
        moving: false,
        checksum: page_checksum(
            &(0..PAGE_SIZE)
                .map(|i| pattern(g, i))
                .collect::<Vec<u8>>()
                .try_into()
                .unwrap(),
        ),
    };
    c.send(
        &ToAgent::Stash {
            batch: BatchId(10),
            pages: vec![stash(12, 0), stash(13, 1)],
        },
        &[],
    )
    .unwrap();
    let stashed = next(&c, |m| match m {
        ToDaemon::StashDone {
            batch: BatchId(10),
            stashed,
            ..
        } => Some(stashed.clone()),
        _ => None,
    });
    assert_eq!(stashed, gfns(&[12, 13]));
    let (watched, _) = watch(&c, 11, &[12, 13]);
    assert_eq!(watched, gfns(&[12, 13]));
    let want13: Vec<u8> = (0..PAGE_SIZE).map(|i| pattern(13, i)).collect();
    assert_eq!(page_of(ptr, 13), want13, "decoded back by a read");
    let (discarded, changed, refused) = discard(&c, 12, &[12, 13]);
    assert_eq!(discarded, gfns(&[12]), "stashed, watched, untouched");
    assert_eq!(changed, gfns(&[13]), "decoded since its watch");
    assert!(refused.is_empty(), "{refused:?}");
    // The blob is no longer read: page 12 reads zeros even with the store overwritten.
    memfd::pwrite_all(store.as_fd(), &[0xee; PAGE_SIZE], 0).unwrap();
    assert!(
        page_of(ptr, 12).iter().all(|&x| x == 0),
        "page 12 reads zeros"
    );
    assert_eq!(page_of(ptr, 13), want13);
}
