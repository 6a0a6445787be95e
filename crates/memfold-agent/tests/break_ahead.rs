//! Breaking ahead of a sequential writer (`fault::BREAK_AHEAD`): a device filling a
//! buffer of shared pages faults page after page, a round trip through the agent each;
//! after two CoW breaks of adjacent pages moments apart the agent breaks the next pages on
//! frames in that direction at once. Here the "guest" writes pages 50 down to 40 of a
//! region shared whole but for page 30 (private, and watched for the free-page discard);
//! the agent must report pages it was not asked to break — 39 down to 31, never written —
//! as broken, stop at page 30, and leave every byte as written: the written pages read
//! their new bytes, the broken-ahead ones their frame's, pages 0–29 stay on their frames.
//! Page 30 keeps its write-protection: written after, it is no longer free, and the
//! discard memfoldd then asks for is refused. Mapping guest RAM back over page 30 (not a
//! page on a frame) would drop its protection, the write would go unseen and the discard
//! would zero it.
//!
//! This test binary plays QEMU (one `memory-backend-memfd` mapped) and memfoldd. One test
//! only: the agent, run in this process, takes every such memfd of the process.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{agent_with_pool, inked, next, page_of, region, share, text, watch, write};
use memfold_wire::{BatchId, FrameId, Gfn, ToAgent, ToDaemon};

/// Guest RAM, pages.
const PAGES: usize = 64;
/// The private page the writer's break-ahead must stop at.
const PRIVATE: usize = 30;

#[test]
fn a_sequential_writer_breaks_ahead_up_to_a_page_not_on_a_frame() {
    let dir = tempfile::tempdir().unwrap();
    let (_fd, ptr) = region(PAGES);
    for g in 0..PAGES {
        write(ptr, g, &text(g));
    }
    let frames: Vec<Vec<u8>> = (0..PAGES).map(text).collect();
    let (c, _pool, _store) = agent_with_pool(&dir.path().join("memfoldd.sock"), &frames);
    // Every page on its own frame, one by one (one mapping each, as the scan's shares of
    // pages that are not on consecutive frames are), but page 30.
    for g in (0..PAGES).filter(|&g| g != PRIVATE) {
        let (shared, _, _) = share(
            &c,
            BatchId(g as u64 + 1),
            vec![(Gfn(g as u32), FrameId(g as u32))],
        );
        assert_eq!(shared, vec![Gfn(g as u32)]);
    }
    let (watched, _) = watch(&c, 1000, &[PRIVATE as u32]);
    assert_eq!(watched, vec![Gfn(PRIVATE as u32)]);

    // The writer: pages 50 down to 40, as a device fills a buffer whose pages the guest
    // allocated in descending order.
    for g in (40..=50).rev() {
        write(ptr, g, &inked(g));
    }

    // The breaks the agent reports, until a second passes without one.
    c.set_recv_timeout(Duration::from_millis(100)).unwrap();
    let mut broken = BTreeSet::new();
    let mut quiet = Instant::now();
    while quiet.elapsed() < Duration::from_secs(1) {
        if let Ok(Some((ToDaemon::CowBroken { breaks }, _))) = c.recv::<ToDaemon>() {
            for (g, f) in breaks {
                assert_eq!(f, FrameId(g.0), "{g} reported broken off the wrong frame");
                broken.insert(g.0 as usize);
            }
            quiet = Instant::now();
        }
    }
    let ahead: BTreeSet<usize> = (PRIVATE + 1..40).collect();
    assert!(
        broken.is_superset(&(40..=50).collect()),
        "every written page is a break: {broken:?}"
    );
    assert!(
        broken.is_superset(&ahead),
        "pages 31–39, never written, broken ahead of the writer: {broken:?}"
    );
    assert!(
        broken.iter().all(|&g| g > PRIVATE),
        "nothing broken past page 30, not on a frame: {broken:?}"
    );

    // Every byte as written: new bytes in 40–50, the frames' in the rest.
    for g in 0..PAGES {
        let want = if (40..=50).contains(&g) {
            inked(g)
        } else {
            text(g)
        };
        assert!(page_of(ptr, g) == want, "page {g} differs");
    }

    // Page 30 is still watched and protected: written now, it is no longer free.
    write(ptr, PRIVATE, &inked(PRIVATE));
    c.send(
        &ToAgent::DiscardFree {
            batch: BatchId(2000),
            gfns: vec![Gfn(PRIVATE as u32)],
        },
        &[],
    )
    .unwrap();
    let (discarded, changed) = next(&c, |m| match m {
        ToDaemon::DiscardDone {
            batch,
            discarded,
            changed,
            ..
        } if *batch == BatchId(2000) => Some((discarded.clone(), changed.clone())),
        _ => None,
    });
    assert!(
        discarded.is_empty(),
        "a written page discarded: {discarded:?}"
    );
    assert_eq!(changed, vec![Gfn(PRIVATE as u32)]);
    assert!(
        page_of(ptr, PRIVATE) == inked(PRIVATE),
        "page 30 lost its write"
    );
}
