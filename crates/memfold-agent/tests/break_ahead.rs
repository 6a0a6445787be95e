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
//! A loaded host can space all of a writer's breaks more than 2 ms apart; the test then
//! does the same in the next of three lanes laid out alike, and fails if none broke
//! ahead.
//!
//! This test binary plays QEMU (one `memory-backend-memfd` mapped) and memfoldd. One test
//! only: the agent, run in this process, takes every such memfd of the process.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{agent_with_pool, inked, next, page_of, region, share, text, watch, write};
use memfold_wire::{BatchId, FrameId, Gfn, ToAgent, ToDaemon};

/// Guest RAM, pages: [`LANES`] lanes of [`LANE`] pages, each laid out alike.
const PAGES: usize = LANES * LANE;
/// Pages a lane.
const LANE: usize = 64;
/// Lanes: a writer is recognised only when two of its breaks come within
/// `SEQUENTIAL_WITHIN` (2 ms), which a loaded host can miss for all ten of a writer's
/// pairs; the test then tries the next lane, and fails only if every lane missed.
const LANES: usize = 8;
/// The private page in each lane the writer's break-ahead must stop at.
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
    let private = |g: usize| g % LANE == PRIVATE;
    // Every page on its own frame, one by one (one mapping each, as the scan's shares of
    // pages that are not on consecutive frames are), but each lane's page 30.
    for g in (0..PAGES).filter(|&g| !private(g)) {
        let (shared, _, _) = share(
            &c,
            BatchId(g as u64 + 1),
            vec![(Gfn(g as u32), FrameId(g as u32))],
        );
        assert_eq!(shared, vec![Gfn(g as u32)]);
    }
    let privates: Vec<u32> = (0..LANES).map(|l| (l * LANE + PRIVATE) as u32).collect();
    let (watched, _) = watch(&c, 1000, &privates);
    assert_eq!(
        watched,
        privates.iter().map(|&g| Gfn(g)).collect::<Vec<_>>()
    );

    c.set_recv_timeout(Duration::from_millis(100)).unwrap();
    let mut written = BTreeSet::new();
    let mut lane = None;
    for l in 0..LANES {
        let base = l * LANE;
        // The writer: pages 50 down to 40 of the lane, as a device fills a buffer whose
        // pages the guest allocated in descending order.
        for g in (base + 40..=base + 50).rev() {
            write(ptr, g, &inked(g));
            written.insert(g);
        }
        // The breaks the agent reports, until a second passes without one.
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
        assert!(
            broken.is_superset(&(base + 40..=base + 50).collect()),
            "every written page is a break: {broken:?}"
        );
        assert!(
            broken.iter().all(|&g| g > base + PRIVATE && g <= base + 50),
            "nothing broken past page 30 of lane {l}, not on a frame: {broken:?}"
        );
        let ahead: BTreeSet<usize> = (base + PRIVATE + 1..base + 40).collect();
        if broken.is_superset(&ahead) {
            lane = Some(l);
            break;
        }
        eprintln!("lane {l}: no two breaks within 2 ms, nothing broken ahead: {broken:?}");
    }
    let lane = lane.unwrap_or_else(|| {
        panic!("pages 31–39, never written, broken ahead of the writer in no lane of {LANES}")
    });

    // Every byte as written: new bytes where written, the frames' in the rest.
    for g in 0..PAGES {
        let want = if written.contains(&g) {
            inked(g)
        } else {
            text(g)
        };
        assert!(page_of(ptr, g) == want, "page {g} differs");
    }

    // The lane's page 30 is still watched and protected: written now, it is no longer
    // free.
    let p = lane * LANE + PRIVATE;
    write(ptr, p, &inked(p));
    c.send(
        &ToAgent::DiscardFree {
            batch: BatchId(2000),
            gfns: vec![Gfn(p as u32)],
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
    assert_eq!(changed, vec![Gfn(p as u32)]);
    assert!(page_of(ptr, p) == inked(p), "page 30 lost its write");
}
